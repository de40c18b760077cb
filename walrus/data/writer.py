"""Write HDF5 files that follow The Well's specification exactly.

Used by the built-in solvers, by the tests, and by the rollout CLI to store predictions.
Layout written (``@`` marks an attribute)::

    / @dataset_name @n_spatial_dims @n_trajectories @grid_type @simulation_parameters @<param>...
    dimensions/    @spatial_dims; time (n_time,), one coordinate array per spatial axis
    boundary_conditions/<axis>_<type>/  @bc_type @associated_dims @associated_fields; mask, values
    scalars/       @field_names; one dataset per scalar
    t0_fields/ t1_fields/ t2_fields/    @field_names; one dataset per field with
                   @time_varying @sample_varying @dim_varying

A field is ``(n_traj, n_time, *spatial[, D | D, D])`` float32; a field constant in time
drops the time axis, one shared across trajectories drops the trajectory axis.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import h5py
import numpy as np

from walrus.atomic import atomic_path
from walrus.bcs import BoundaryType

BcSpec = str | int | BoundaryType | tuple[str | int | BoundaryType, str | int | BoundaryType]


def _strings(values: Sequence[str]) -> np.ndarray:
    return np.array([str(v) for v in values], dtype=h5py.string_dtype())


def _check_field(
    name: str,
    arr: np.ndarray,
    rank: int,
    n_traj: int,
    n_time: int,
    spatial: tuple[int, ...],
    varying: tuple[bool, bool],
) -> None:
    if arr.dtype.kind not in "iuf":  # bool, complex, strings, objects
        raise ValueError(
            f"field {name!r} has dtype {arr.dtype}: fields must be real numbers "
            "(write the real and imaginary parts of a complex field as two fields)"
        )
    time_varying, sample_varying = varying
    expected = (
        ((n_traj,) if sample_varying else ())
        + ((n_time,) if time_varying else ())
        + spatial
        + (len(spatial),) * rank
    )
    if arr.shape != expected:
        raise ValueError(
            f"field {name!r} has shape {arr.shape}, expected {expected} "
            f"(time_varying={time_varying}, sample_varying={sample_varying})"
        )


def write_well_file(
    path: str | os.PathLike,
    dataset_name: str,
    *,
    coords: Mapping[str, np.ndarray],
    time: np.ndarray,
    n_trajectories: int,
    fields: Mapping[str, np.ndarray] | None = None,
    vector_fields: Mapping[str, np.ndarray] | None = None,
    tensor_fields: Mapping[str, np.ndarray] | None = None,
    varying: Mapping[str, tuple[bool, bool]] | None = None,
    bcs: Mapping[str, BcSpec] | None = None,
    params: Mapping[str, float] | None = None,
    scalars: Mapping[str, np.ndarray] | None = None,
    grid_type: str = "cartesian",
    symmetric: Mapping[str, bool] | None = None,
) -> Path:
    """Write one Well file atomically (temporary file, then rename).

    Args:
        path: destination ``.hdf5`` path; parent folders are created.
        dataset_name: the ``dataset_name`` root attribute.
        coords: ordered spatial axis name -> coordinate array ``(N_axis,)``, e.g. ``{"x": .., "y": ..}``.
        time: ``(n_time,)`` sample times.
        n_trajectories: number of trajectories ``n_traj``.
        fields: scalar (t0) fields ``(n_traj, n_time, *spatial)``.
        vector_fields: vector (t1) fields ``(n_traj, n_time, *spatial, D)``.
        tensor_fields: tensor (t2) fields ``(n_traj, n_time, *spatial, D, D)``.
        varying: field name -> ``(time_varying, sample_varying)`` for fields that drop the
            time and/or trajectory axis; others are ``(True, True)``.
        bcs: axis name -> boundary type for both sides, or ``(lo, hi)``; default periodic.
        params: simulation parameters, written to ``simulation_parameters`` and one
            attribute each.
        scalars: name -> array; ``(1,)`` constant, or ``(n_time,)`` time-varying.
        grid_type: the ``grid_type`` root attribute.
        symmetric: t2 field name -> whether the tensor is symmetric (default False).

    Returns:
        The written path.
    """
    path = Path(path)
    axes = list(coords)
    n_spatial = len(axes)
    if not 1 <= n_spatial <= 3:
        raise ValueError(f"{path}: need 1-3 spatial axes, got {axes}")
    spatial = tuple(int(np.asarray(coords[a]).shape[0]) for a in axes)
    time = np.asarray(time)
    if time.ndim != 1:
        raise ValueError(f"{path}: time must be 1-D, got shape {time.shape}")
    if not np.issubdtype(time.dtype, np.number) or np.iscomplexobj(time):
        raise ValueError(f"{path}: time must hold real numbers, got dtype {time.dtype}")
    if not np.isfinite(time).all():
        raise ValueError(f"{path}: time holds NaN or Inf")
    n_time = time.shape[0]
    varying = dict(varying or {})
    groups = {
        "t0_fields": (dict(fields or {}), 0),
        "t1_fields": (dict(vector_fields or {}), 1),
        "t2_fields": (dict(tensor_fields or {}), 2),
    }
    all_names = [n for g, _ in groups.values() for n in g]
    if not all_names:
        raise ValueError(f"{path}: no fields to write")
    if len(set(all_names)) != len(all_names):
        raise ValueError(f"{path}: duplicate field names {all_names}")
    for group, rank in groups.values():
        for name, arr in group.items():
            flags = tuple(varying.get(name, (True, True)))
            _check_field(name, np.asarray(arr), rank, n_trajectories, n_time, spatial, flags)
    bcs = dict(bcs or {})
    unknown = set(bcs) - set(axes)
    if unknown:
        raise ValueError(f"{path}: boundary conditions for unknown axes {sorted(unknown)}")

    # built in memory, then written in one go: a full disk is then a plain OSError (ENOSPC) on
    # that write, never an HDF5 file whose failed close crashes the interpreter at exit
    with h5py.File(buffer := io.BytesIO(), "w") as f:
        f.attrs["dataset_name"] = dataset_name
        f.attrs["n_spatial_dims"] = n_spatial
        f.attrs["n_trajectories"] = int(n_trajectories)
        f.attrs["grid_type"] = grid_type
        params = dict(params or {})
        f.attrs["simulation_parameters"] = _strings(list(params))
        for key, value in params.items():
            f.attrs[key] = value

        dims = f.create_group("dimensions")
        dims.attrs["spatial_dims"] = _strings(axes)
        ds = dims.create_dataset("time", data=time.astype(np.float32))
        ds.attrs["sample_varying"] = False
        ds.attrs["time_varying"] = True
        for a in axes:
            ds = dims.create_dataset(a, data=np.asarray(coords[a], dtype=np.float32))
            ds.attrs["sample_varying"] = False
            ds.attrs["time_varying"] = False

        bgroup = f.create_group("boundary_conditions")
        for i, a in enumerate(axes):
            spec = bcs.get(a, "periodic")
            lo, hi = spec if isinstance(spec, tuple | list) else (spec, spec)
            lo, hi = BoundaryType.parse(lo), BoundaryType.parse(hi)
            sides = [(lo, (True, True))] if lo == hi else [(lo, (True, False)), (hi, (False, True))]
            for bc, (at_lo, at_hi) in sides:
                suffix = "" if lo == hi else ("_lo" if at_lo else "_hi")
                g = bgroup.create_group(f"{a}{suffix}_{bc.name.lower()}")
                g.attrs["bc_type"] = bc.name.lower()
                g.attrs["associated_dims"] = _strings([a])
                g.attrs["associated_fields"] = _strings([])
                g.attrs["sample_varying"] = False
                g.attrs["time_varying"] = False
                mask = np.zeros(spatial[i], dtype=bool)
                mask[0], mask[-1] = at_lo, at_hi
                g.create_dataset("mask", data=mask)
                g.create_dataset("values", data=np.zeros(int(mask.sum()), dtype=np.float32))

        sgroup = f.create_group("scalars")
        scalars = dict(scalars or {})
        sgroup.attrs["field_names"] = _strings(list(scalars))
        for key, value in scalars.items():
            value = np.atleast_1d(np.asarray(value, dtype=np.float32))
            ds = sgroup.create_dataset(key, data=value)
            ds.attrs["time_varying"] = value.shape[0] == n_time and n_time > 1
            ds.attrs["sample_varying"] = False

        for gname, (group, rank) in groups.items():
            g = f.create_group(gname)
            g.attrs["field_names"] = _strings(list(group))
            for name, arr in group.items():
                time_varying, sample_varying = varying.get(name, (True, True))
                data = np.ascontiguousarray(arr, dtype=np.float32)
                # one frame per chunk keeps window reads cheap on large files
                chunk = (1,) * (int(sample_varying) + int(time_varying)) + data.shape[
                    int(sample_varying) + int(time_varying) :
                ]
                ds = g.create_dataset(name, data=data, chunks=chunk if data.size else None)
                ds.attrs["time_varying"] = bool(time_varying)
                ds.attrs["sample_varying"] = bool(sample_varying)
                ds.attrs["dim_varying"] = np.ones(n_spatial, dtype=bool)
                if rank == 2:
                    sym = bool((symmetric or {}).get(name, False))
                    ds.attrs["symmetric"] = sym
                    ds.attrs["antisymmetric"] = False
    with atomic_path(path) as tmp, open(tmp, "wb") as out:
        out.write(buffer.getbuffer())
    return path
