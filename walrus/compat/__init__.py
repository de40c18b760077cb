"""Use the official Walrus weights with this project's model.

Both official layouts convert: the legacy one (``space_bag``) and the current one of the
released ``walrus.pt``. ``load_official(path_or_state_dict, ...) -> (model, vocab)`` converts
in memory; ``python -m walrus.compat convert OFFICIAL.pt OUT.ckpt`` writes a walrus checkpoint
that ``walrus.checkpoint.load_model``, ``infer.py`` and ``train.py init_from=`` read.

Modules, one job each: :mod:`~walrus.compat.inputs` (reading official files, field names and
configs), :mod:`~walrus.compat.keymap` (the two key layouts and the key map),
:mod:`~walrus.compat.infer` (our model config from the official shapes),
:mod:`~walrus.compat.convert` (conversion and the checkpoint it writes),
:mod:`~walrus.compat.released` (facts about the released checkpoint).
"""

from walrus.compat.convert import (
    ConversionReport,
    Converted,
    convert_file,
    convert_state_dict,
    load_official,
)
from walrus.compat.inputs import read_official_file, unwrap_state_dict
from walrus.compat.keymap import check_layout

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
