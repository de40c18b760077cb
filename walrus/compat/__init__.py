"""Use the official Walrus weights with this project's model.

Both official layouts convert: the legacy one (``space_bag``) and the current one of the
released ``walrus.pt``. ``load_official(path_or_state_dict, ...) -> (model, vocab)`` converts
in memory; ``python -m walrus.compat convert OFFICIAL.pt OUT.ckpt`` writes a walrus checkpoint
that ``walrus.checkpoint.load_model``, ``infer.py`` and ``train.py init_from=`` read.
"""

from walrus.compat.official import (
    ConversionReport,
    Converted,
    check_layout,
    convert_file,
    convert_state_dict,
    load_official,
    read_official_file,
    unwrap_state_dict,
)

__all__ = [
    "ConversionReport",
    "Converted",
    "check_layout",
    "convert_file",
    "convert_state_dict",
    "load_official",
    "read_official_file",
    "unwrap_state_dict",
]
