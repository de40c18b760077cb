"""The Well's HDF5 file format: split layout, file metadata, and reading frames of a trajectory.

A dataset directory is ``{root}/{dataset}/data/{split}/*.hdf5`` (the layout of a real Well
download). Each file holds ``n_trajectories`` trajectories of ``n_time`` frames.

Vector (t1) and tensor (t2) fields are flattened into named components: ``velocity`` on axes
``x, y`` becomes ``velocity_x, velocity_y``; ``stress`` becomes ``stress_xx, stress_xy, ...``.
Fields constant in time, shared across trajectories, or constant along an axis are broadcast.

Shape legend: T time, C channels (field components), S spatial axes (1-3).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from walrus.bcs import BoundaryType

FIELD_GROUPS = ("t0_fields", "t1_fields", "t2_fields")
SPLITS = ("train", "valid", "test")


def _as_str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return _as_str(value.item())
    return str(value)


def _as_strs(value: Any) -> list[str]:
    if isinstance(value, str | bytes):
        return [_as_str(value)]
    return [_as_str(v) for v in np.atleast_1d(np.asarray(value, dtype=object))]


def _attr(obj: h5py.HLObject, key: str, path: Path) -> Any:
    if key not in obj.attrs:
        where = obj.name if obj.name != "/" else "the root group"
        raise ValueError(f"{path}: attribute {key!r} is missing from {where}")
    return obj.attrs[key]


def _group(f: h5py.File, key: str, path: Path) -> h5py.Group:
    if key not in f or not isinstance(f[key], h5py.Group):
        raise ValueError(f"{path}: group {key!r} is missing; not a Well file?")
    return f[key]


def open_h5(path: str | os.PathLike) -> h5py.File:
    """Open an HDF5 file read-only.

    Raises (each naming the file): FileNotFoundError if it does not exist, PermissionError if
    it may not be read, ValueError for a directory or a non-HDF5 or truncated file.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not an HDF5 file")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file, so not an HDF5 file")
    try:
        return h5py.File(path, "r")
    except PermissionError:
        raise PermissionError(
            f"{path}: permission denied; this user may not read it (check its permissions)"
        ) from None
    except OSError as e:
        raise ValueError(
            f"{path}: cannot be opened as HDF5 (not an HDF5 file, or truncated): {e}"
        ) from None


@dataclass(frozen=True)
class FieldInfo:
    """One stored field and the channel names it flattens into.

    Attributes:
        name: dataset name inside its group (``velocity``).
        group: ``t0_fields``, ``t1_fields`` or ``t2_fields``.
        rank: tensor order (0, 1 or 2).
        components: channel names (``velocity_x``, ``velocity_y``).
        time_varying: whether the dataset has a time axis.
        sample_varying: whether the dataset has a trajectory axis.
        dim_varying: per spatial axis, whether the dataset has that axis.
        flat_tensor: t2 stored as ``D*D`` on one trailing axis rather than ``(D, D)``.
    """

    name: str
    group: str
    rank: int
    components: tuple[str, ...]
    time_varying: bool
    sample_varying: bool
    dim_varying: tuple[bool, ...]
    flat_tensor: bool = False


class WellFile:
    """Metadata of one Well HDF5 file, read once; the file is closed afterwards.

    Args:
        path: the ``.hdf5`` file.

    Attributes:
        path, dataset_name, n_spatial, spatial_dims (axis names), spatial_shape,
        n_trajectories, n_time, time (``(n_time,)`` or ``(n_traj, n_time)``),
        bcs (``(n_spatial, 2)`` int, ``BoundaryType`` codes lo/hi per axis),
        scalars (name -> array), params (simulation parameters), fields (``FieldInfo`` list),
        field_names (all flattened channel names, in file order).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with open_h5(self.path) as f:
            try:
                self._read(f)
            except (KeyError, OSError, RuntimeError, TypeError) as e:
                raise ValueError(f"{self.path}: malformed Well file: {e}") from None

    def _read(self, f: h5py.File) -> None:
        p = self.path
        self.dataset_name = _as_str(f.attrs.get("dataset_name", p.parent.parent.parent.name))
        self.n_spatial = int(_attr(f, "n_spatial_dims", p))
        self.n_trajectories = int(_attr(f, "n_trajectories", p))
        self.grid_type = _as_str(f.attrs.get("grid_type", "cartesian"))
        self.params: dict[str, Any] = {}
        for key in _as_strs(f.attrs.get("simulation_parameters", [])):
            if key in f.attrs:
                value = f.attrs[key]
                self.params[key] = value.item() if isinstance(value, np.generic) else value

        dims = _group(f, "dimensions", p)
        self.spatial_dims = _as_strs(_attr(dims, "spatial_dims", p))
        if len(self.spatial_dims) != self.n_spatial or not 1 <= self.n_spatial <= 3:
            raise ValueError(
                f"{p}: n_spatial_dims={self.n_spatial} but dimensions/spatial_dims lists "
                f"{self.spatial_dims}; need 1-3 spatial axes"
            )
        for key in ("time", *self.spatial_dims):
            if key not in dims:
                raise ValueError(f"{p}: dataset 'dimensions/{key}' is missing")
        self.time = self._read_time(dims["time"])
        self.n_time = int(self.time.shape[-1])
        self.spatial_shape = tuple(int(dims[a].shape[-1]) for a in self.spatial_dims)
        self.coords = {a: np.asarray(dims[a][()]) for a in self.spatial_dims}

        self.bcs = self._read_bcs(_group(f, "boundary_conditions", p))
        self.scalars: dict[str, np.ndarray] = {}
        if "scalars" in f:
            for key in _as_strs(f["scalars"].attrs.get("field_names", [])):
                if key in f["scalars"]:
                    self.scalars[key] = np.asarray(f["scalars"][key][()])

        self.fields: list[FieldInfo] = []
        for rank, gname in enumerate(FIELD_GROUPS):
            if gname not in f:
                continue
            g = f[gname]
            for name in _as_strs(_attr(g, "field_names", p)):
                if name not in g:
                    raise ValueError(
                        f"{p}: field {name!r} is listed in {gname}/field_names but missing"
                    )
                self.fields.append(self._field_info(g[name], gname, name, rank))
        if not self.fields:
            raise ValueError(f"{p}: no fields in t0_fields/t1_fields/t2_fields")
        self.field_names = [c for fi in self.fields for c in fi.components]
        if len(set(self.field_names)) != len(self.field_names):
            raise ValueError(f"{p}: duplicate field component names {self.field_names}")

    def _read_time(self, ds: h5py.Dataset) -> np.ndarray:
        """The time coordinate as float64; complex, non-numeric or non-finite times are refused."""
        if ds.dtype.kind not in "fiu":
            raise ValueError(
                f"{self.path}: dimensions/time has dtype {ds.dtype}; time must be real numbers"
            )
        time = np.asarray(ds[()], dtype=np.float64)  # (n_time,) or (n_traj, n_time)
        if time.ndim == 0:
            raise ValueError(f"{self.path}: dimensions/time is a scalar; need one time per frame")
        bad = np.flatnonzero(~np.isfinite(time.reshape(-1)))
        if bad.size:
            where = np.unravel_index(bad[0], time.shape)
            raise ValueError(
                f"{self.path}: dimensions/time holds NaN or Inf ({bad.size} of {time.size} "
                f"values, the first at index {tuple(int(i) for i in where)})"
            )
        return time

    def _read_bcs(self, group: h5py.Group) -> np.ndarray:
        """Boundary type of each axis side, by the rules The Well's own reader applies.

        A side that no group marks is open. A group's ``mask`` spans its ``associated_dims`` in
        that order (or every spatial axis); on a side of one of those axes the group applies if
        any of its mask there is set, or, for a wall, if all of it is. Groups are applied in the
        file's group order, a later one replacing an earlier one on the sides it marks. A group
        over several axes gets The Well's warning that only axis-aligned boundaries are exact.
        A group without a mask (or with a 0-d one) covers both sides of its axes.
        """
        p = self.path
        bcs = np.full((self.n_spatial, 2), int(BoundaryType.OPEN), dtype=np.int64)
        for gname, g in group.items():
            if not isinstance(g, h5py.Group):
                continue
            where = f"{p}: boundary_conditions/{gname}"
            try:
                bc = BoundaryType.parse(_as_str(_attr(g, "bc_type", p)))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            dims = _as_strs(_attr(g, "associated_dims", p))
            for dim in dims:
                if dim not in self.spatial_dims:
                    raise ValueError(f"{where} names axis {dim!r}, not one of {self.spatial_dims}")
            if len(dims) > 1:
                warnings.warn(
                    f"{where} spans axes {dims}: only axis-aligned boundaries are exact; each "
                    "side counts as open or periodic if any of the mask there is, wall only if "
                    "all of it is",
                    RuntimeWarning,
                    stacklevel=2,
                )
            mask = np.asarray(g["mask"][()], dtype=bool) if "mask" in g else np.ones((), bool)
            if mask.ndim == 0:
                mask_axes = dims
                mask = np.broadcast_to(mask, (2,) * len(dims))  # both sides of each axis
            elif mask.ndim == len(dims):
                mask_axes = dims
            elif mask.ndim == self.n_spatial:
                mask_axes = self.spatial_dims
            else:
                raise ValueError(
                    f"{where}: mask has {mask.ndim} axes, but associated_dims lists {dims}"
                )
            if mask.size == 0:
                raise ValueError(f"{where}: mask is empty")
            reduce = np.all if bc == BoundaryType.WALL else np.any
            for dim in dims:
                ax = mask_axes.index(dim)
                ends = np.moveaxis(mask, ax, 0)  # (N_dim, ...other mask axes)
                for side, end in ((0, ends[0]), (1, ends[-1])):
                    if reduce(end):
                        bcs[self.spatial_dims.index(dim), side] = int(bc)
        return bcs

    def _field_info(self, ds: h5py.Dataset, group: str, name: str, rank: int) -> FieldInfo:
        p, d = self.path, self.n_spatial
        kind = ds.dtype.kind
        if kind == "c":
            raise ValueError(
                f"{p}: field {group}/{name} is complex ({ds.dtype}); walrus reads real fields "
                "only (store the real and imaginary parts as two fields)"
            )
        if kind == "b":
            raise ValueError(
                f"{p}: field {group}/{name} is boolean; walrus reads real-valued fields only "
                "(store a mask as float 0/1 if it is meant as an input field)"
            )
        if kind not in "fiu":
            raise ValueError(
                f"{p}: field {group}/{name} has dtype {ds.dtype}; fields must be real numbers"
            )
        time_varying = bool(ds.attrs.get("time_varying", True))
        sample_varying = bool(ds.attrs.get("sample_varying", True))
        dim_varying = tuple(bool(v) for v in np.atleast_1d(ds.attrs.get("dim_varying", [True] * d)))
        if len(dim_varying) != d:
            raise ValueError(
                f"{p}: field {name!r} has dim_varying of length {len(dim_varying)}, expected {d}"
            )
        lead = ((self.n_trajectories,) if sample_varying else ()) + (
            (self.n_time,) if time_varying else ()
        )
        lead += tuple(n for n, v in zip(self.spatial_shape, dim_varying) if v)
        flat = False
        if ds.shape == lead + (d,) * rank:
            pass
        elif rank == 2 and ds.shape == lead + (d * d,):
            flat = True
        else:
            raise ValueError(
                f"{p}: field {group}/{name} has shape {ds.shape}, but the dimensions and its "
                f"attributes (time_varying={time_varying}, sample_varying={sample_varying}, "
                f"dim_varying={list(dim_varying)}) imply {lead + (d,) * rank}"
            )
        axes = self.spatial_dims
        if rank == 0:
            comps: tuple[str, ...] = (name,)
        elif rank == 1:
            comps = tuple(f"{name}_{a}" for a in axes)
        else:
            comps = tuple(f"{name}_{a}{b}" for a in axes for b in axes)
        return FieldInfo(name, group, rank, comps, time_varying, sample_varying, dim_varying, flat)

    def select(self, names: Sequence[str] | None) -> list[tuple[FieldInfo, list[int]]]:
        """Fields and component indices for channel ``names`` (component or whole-field names).

        ``None`` selects everything. Channel order follows ``names``.
        """
        if names is None:
            return [(fi, list(range(len(fi.components)))) for fi in self.fields]
        out: list[tuple[FieldInfo, list[int]]] = []
        for n in names:
            hit = next((fi for fi in self.fields if fi.name == n), None)
            if hit is not None:
                out.append((hit, list(range(len(hit.components)))))
                continue
            hit = next((fi for fi in self.fields if n in fi.components), None)
            if hit is None:
                raise ValueError(
                    f"{self.path}: unknown field {n!r}; this file has {self.field_names}"
                )
            out.append((hit, [hit.components.index(n)]))
        return out

    def channel_names(self, names: Sequence[str] | None = None) -> list[str]:
        """Flattened channel names of ``select(names)``; a channel named twice is an error."""
        channels = [fi.components[c] for fi, comps in self.select(names) for c in comps]
        dupes = sorted({n for n in channels if channels.count(n) > 1})
        if dupes:
            raise ValueError(
                f"{self.path}: fields conflict, channel names {dupes} appear more than once; each "
                "channel needs its own name to get its own vocabulary slot"
            )
        return channels

    def read(
        self,
        handle: h5py.File,
        selection: list[tuple[FieldInfo, list[int]]],
        trajectory: int,
        start: int,
        n_frames: int,
        stride: int = 1,
        check_finite: bool = True,
    ) -> np.ndarray:
        """Read frames ``start, start+stride, ...`` (``n_frames`` of them) of one trajectory.

        Returns:
            ``(n_frames, C, *spatial)`` float32.
        """
        p = self.path
        stop = start + (n_frames - 1) * stride + 1
        if not 0 <= trajectory < self.n_trajectories:
            raise ValueError(
                f"{p}: trajectory {trajectory} out of range [0, {self.n_trajectories})"
            )
        if start < 0 or stop > self.n_time or n_frames < 1 or stride < 1:
            raise ValueError(
                f"{p}: window of {n_frames} frames from time index {start} at stride {stride} "
                f"needs time steps up to {stop - 1}, but the trajectory has {self.n_time}"
            )
        chans = []
        for fi, comps in selection:
            ds_name = f"{fi.group}/{fi.name}"
            idx: tuple[Any, ...] = ()
            if fi.sample_varying:
                idx += (trajectory,)
            if fi.time_varying:
                idx += (slice(start, stop, stride),)
            try:
                arr = handle[ds_name][idx] if idx else handle[ds_name][()]
            except (OSError, KeyError, RuntimeError) as e:
                raise ValueError(
                    f"{p}: cannot read field {ds_name!r} at trajectory {trajectory}, "
                    f"time {start}:{stop}:{stride} (corrupt or truncated file?): {e}"
                ) from None
            if not fi.time_varying:
                arr = arr[None]  # (1, ...)
            for ax, varies in enumerate(fi.dim_varying):
                if not varies:
                    arr = np.expand_dims(arr, 1 + ax)
            if fi.rank == 0:
                arr = arr[..., None]
            elif fi.rank == 2 and not fi.flat_tensor:
                arr = arr.reshape(*arr.shape[:-2], -1)
            arr = np.broadcast_to(arr, (n_frames, *self.spatial_shape, arr.shape[-1]))
            chans.append(arr[..., comps])
        out = np.concatenate(chans, axis=-1)  # (T, *spatial, C)
        out = np.ascontiguousarray(np.moveaxis(out, -1, 1), dtype=np.float32)  # (T, C, *spatial)
        if check_finite and not np.isfinite(out).all():
            bad_t, bad_c = np.nonzero(~np.isfinite(out).reshape(n_frames, out.shape[1], -1).all(-1))
            names = [fi.components[c] for fi, comps in selection for c in comps]
            raise ValueError(
                f"{p}: NaN or Inf in field {names[bad_c[0]]!r}, trajectory {trajectory}, "
                f"time index {start + bad_t[0] * stride}"
            )
        return out


def list_split_files(root: str | os.PathLike, dataset: str, split: str) -> list[Path]:
    """Sorted ``{root}/{dataset}/data/{split}/*.hdf5`` files; a missing directory or none is an error."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"data root {root} does not exist")
    ddir = root / dataset
    if not ddir.is_dir():
        available = sorted(d.name for d in root.iterdir() if d.is_dir())
        raise FileNotFoundError(f"dataset directory {ddir} does not exist (found: {available})")
    sdir = ddir / "data" / split
    if not sdir.is_dir():
        raise FileNotFoundError(
            f"split directory {sdir} does not exist (expected data/{{train,valid,test}})"
        )
    files = sorted(
        p for p in sdir.iterdir() if p.suffix in (".hdf5", ".h5") and not p.name.startswith(".")
    )
    if not files:
        raise FileNotFoundError(f"split directory {sdir} holds no .hdf5 files")
    return files


def read_trajectory(
    path: str | os.PathLike,
    trajectory: int,
    fields: Sequence[str] | None = None,
    stride: int = 1,
    check_finite: bool = True,
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Read one whole trajectory of a Well file.

    Args:
        path: the ``.hdf5`` file.
        trajectory: trajectory index in the file.
        fields: channel subset (component or whole-field names); default all.
        stride: time stride.
        check_finite: raise on NaN/Inf.

    Returns:
        ``(frames (T, C, *spatial) float32, channel names, bcs (n_spatial, 2) int)``.
    """
    wf = WellFile(path)
    sel = wf.select(fields)
    n = (wf.n_time - 1) // stride + 1
    with open_h5(wf.path) as h:
        frames = wf.read(h, sel, trajectory, 0, n, stride, check_finite)
    names = [fi.components[c] for fi, comps in sel for c in comps]
    return frames, names, wf.bcs.copy()
