"""Data in The Well's HDF5 format: reading (``walrus.data.well_dataset``, ``datamodule``) and
writing your own (:func:`write_well_file`)."""

from walrus.data.writer import write_well_file

__all__ = ["write_well_file"]
