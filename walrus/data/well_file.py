"""The Well's HDF5 file format: split layout, file metadata, and reading frames of a trajectory.

A dataset directory is ``{root}/{dataset}/data/{split}/*.hdf5`` (the layout of a real Well
download). Each file holds ``n_trajectories`` trajectories of ``n_time`` frames.

Vector (t1) and tensor (t2) fields are flattened into named components: ``velocity`` on axes
``x, y`` becomes ``velocity_x, velocity_y``; ``stress`` becomes ``stress_xx, stress_xy, ...``.
Fields constant in time, shared across trajectories, or constant along an axis are broadcast.

Files are opened through fsspec (``walrus.data.storage``), local paths and URLs alike, and only
the frames a window needs are read. What a file declares is checked before anything large is
read (see ``WellFile`` and ``WellFile.check_read_size``).

Shape legend: T time, C channels (field components), S spatial axes (1-3).
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from walrus.bcs import BoundaryType
from walrus.memory import default_max_sample_bytes
from walrus.data.storage import (
    Location,
    as_location,
    data_root_exists,
    is_dir,
    join,
    list_dir,
    list_folders,
    name,
    open_binary,
    parent,
)

FIELD_GROUPS = ("t0_fields", "t1_fields", "t2_fields")
SPLITS = ("train", "valid", "test")

# Arrays read whole when a file is opened (time, coordinates, scalars, boundary masks) and the
# trajectory count may not declare more entries than this; fields are read one window at a time.
MAX_WHOLE_ENTRIES = 10**7


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _as_str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return _as_str(value.item())
    return str(value)


def _as_strs(value: Any) -> list[str]:
    if isinstance(value, str | bytes):
        return [_as_str(value)]
    return [_as_str(v) for v in np.atleast_1d(np.asarray(value, dtype=object)).reshape(-1)]


def _attr(obj: h5py.HLObject, key: str, path: Location) -> Any:
    if key not in obj.attrs:
        where = obj.name if obj.name != "/" else "the root group"
        raise ValueError(f"{path}: attribute {key!r} is missing from {where}")
    return obj.attrs[key]


def _where(obj: h5py.HLObject) -> str:
    return "the root group" if obj.name == "/" else str(obj.name).lstrip("/")


def _int_attr(obj: h5py.HLObject, key: str, path: Location, lo: int, hi: int) -> int:
    """Integer attribute ``key`` of ``obj`` in ``[lo, hi]``."""
    value = _attr(obj, key, path)
    arr = np.asarray(value)
    ok = arr.size == 1 and (arr.dtype.kind in "iu" or (arr.dtype.kind == "f" and arr.ndim == 0))
    if ok:
        v = arr.reshape(()).item()
        ok = isinstance(v, int) or (math.isfinite(v) and float(v).is_integer())
    if not ok:
        raise ValueError(
            f"{path}: attribute {key!r} of {_where(obj)} must be an integer, got {value!r:.60}"
        )
    v = int(v)
    if not lo <= v <= hi:
        raise ValueError(
            f"{path}: attribute {key!r} of {_where(obj)} is {v}; it must be in [{lo}, {hi:,}]"
        )
    return v


def _bool_attr(obj: h5py.HLObject, key: str, path: Location, default: bool) -> bool:
    if key not in obj.attrs:
        return default
    arr = np.asarray(obj.attrs[key])
    if arr.size != 1 or arr.dtype.kind not in "biu" or arr.reshape(()).item() not in (0, 1):
        raise ValueError(
            f"{path}: attribute {key!r} of {_where(obj)} must be true or false, got "
            f"{obj.attrs[key]!r:.60}"
        )
    return bool(arr.reshape(()).item())


def _plain_name(value: str, path: Location, where: str) -> str:
    """A dataset or group name listed in an attribute: one path component, never a path."""
    if not value or value in (".", "..") or "/" in value or "\0" in value:
        raise ValueError(
            f"{path}: {where} lists {value!r}, which is not a plain dataset name (no '/', "
            "not empty)"
        )
    return value


def _check_storage(ds: h5py.Dataset, path: Location) -> None:
    """Refuse data kept outside the file: HDF5 external raw storage and virtual datasets."""
    where = str(ds.name).lstrip("/")
    if ds.is_virtual:
        raise ValueError(
            f"{path}: dataset {where} is a virtual dataset (its data lives in other datasets or "
            "files); walrus reads only data stored in the file itself"
        )
    if ds.external:
        raise ValueError(
            f"{path}: dataset {where} keeps its data in external raw storage "
            f"({ds.external[0][0]!r}); walrus refuses it, since it can point at any file"
        )


def _member(group: h5py.Group, key: str, path: Location, kind: type = h5py.Dataset) -> Any:
    """Member ``key`` of ``group``, checked to be a ``kind`` held in this file."""
    where = f"{_where(group)}/{key}" if group.name != "/" else key
    link = group.get(key, getlink=True)
    if link is None:
        what = "group" if kind is h5py.Group else "dataset"
        suffix = "; not a Well file?" if kind is h5py.Group else ""
        raise ValueError(f"{path}: {what} {where!r} is missing{suffix}")
    if isinstance(link, h5py.ExternalLink):
        raise ValueError(
            f"{path}: {where} is a link to another file ({link.filename}); walrus reads only "
            "data stored in the file itself"
        )
    obj = group.get(key)
    if not isinstance(obj, kind):
        what = "a group" if kind is h5py.Group else "a dataset"
        raise ValueError(f"{path}: {where} is not {what}")
    if isinstance(obj, h5py.Dataset):
        _check_storage(obj, path)
    return obj


def _group(f: h5py.File, key: str, path: Location) -> h5py.Group:
    return _member(f, key, path, h5py.Group)


def _read_whole(ds: h5py.Dataset, path: Location) -> np.ndarray:
    """All of a small dataset (time, a coordinate, a scalar, a mask), bounded before reading."""
    where = str(ds.name).lstrip("/")
    if ds.shape is None:
        raise ValueError(f"{path}: dataset {where} holds no data (an empty dataspace)")
    if ds.size > MAX_WHOLE_ENTRIES:
        raise ValueError(
            f"{path}: dataset {where} declares shape {ds.shape} ({ds.size:,} entries); walrus "
            f"reads it whole and refuses more than {MAX_WHOLE_ENTRIES:,}"
        )
    return np.asarray(ds[()])


def open_h5(path: str | os.PathLike) -> h5py.File:
    """Open an HDF5 file read-only: a local path or an fsspec URL, both through fsspec.

    The fsspec file object is closed when the returned handle is garbage-collected.

    Raises (each naming the file): FileNotFoundError if it does not exist, PermissionError if
    it may not be read, ValueError for a directory, a FIFO or device, or a non-HDF5 or
    truncated file.
    """
    loc = as_location(path)
    fileobj = open_binary(loc)
    try:
        handle = h5py.File(fileobj, "r")
    except PermissionError:
        fileobj.close()
        raise PermissionError(
            f"{loc}: permission denied; this user may not read it (check its permissions)"
        ) from None
    except (OSError, ValueError) as e:
        fileobj.close()
        raise ValueError(
            f"{loc}: cannot be opened as HDF5 (not an HDF5 file, or truncated): {_one_line(e)}"
        ) from None
    weakref.finalize(handle, fileobj.close)
    return handle


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
        shape: the dataset's shape, as checked against the file's dimensions.
        itemsize: bytes per stored value.
    """

    name: str
    group: str
    rank: int
    components: tuple[str, ...]
    time_varying: bool
    sample_varying: bool
    dim_varying: tuple[bool, ...]
    flat_tensor: bool = False
    shape: tuple[int, ...] = ()
    itemsize: int = 4


class WellFile:
    """Metadata of one Well HDF5 file, read once; the file is closed afterwards.

    Opening checks every declared size before reading anything: each field's shape against the
    grid, time and trajectory counts; at most ``MAX_WHOLE_ENTRIES`` entries in what is read
    whole (time, coordinates, scalars, boundary masks) and trajectories; strictly increasing
    time; masks matching their axes. Data outside the file (external raw storage, virtual
    datasets, external links) is refused. Each failure is a one-line ``ValueError`` naming
    the file.

    Args:
        path: the ``.hdf5`` file, a local path or an fsspec URL.

    Attributes:
        path, dataset_name, n_spatial, spatial_dims (axis names), spatial_shape,
        n_trajectories, n_time, time (``(n_time,)`` or ``(n_traj, n_time)``),
        bcs (``(n_spatial, 2)`` int, ``BoundaryType`` codes lo/hi per axis),
        scalars (name -> array), params (simulation parameters), fields (``FieldInfo`` list),
        field_names (all flattened channel names, in file order).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = as_location(path)
        with open_h5(self.path) as f:
            try:
                self._read(f)
            except (
                KeyError,
                OSError,
                RuntimeError,
                TypeError,
                AttributeError,
                IndexError,
                OverflowError,
                UnicodeDecodeError,
            ) as e:
                raise ValueError(f"{self.path}: malformed Well file: {_one_line(e)}") from None

    def _read(self, f: h5py.File) -> None:
        p = self.path
        default_name = name(parent(parent(parent(p))))
        self.dataset_name = _as_str(f.attrs.get("dataset_name", default_name))
        self.n_spatial = _int_attr(f, "n_spatial_dims", p, 1, 3)
        self.n_trajectories = _int_attr(f, "n_trajectories", p, 1, MAX_WHOLE_ENTRIES)
        self.grid_type = _as_str(f.attrs.get("grid_type", "cartesian"))
        self.params: dict[str, Any] = {}
        for key in _as_strs(f.attrs.get("simulation_parameters", [])):
            if key in f.attrs:
                value = f.attrs[key]
                self.params[key] = value.item() if isinstance(value, np.generic) else value

        dims = _group(f, "dimensions", p)
        self.spatial_dims = _as_strs(_attr(dims, "spatial_dims", p))
        if len(self.spatial_dims) != self.n_spatial:
            raise ValueError(
                f"{p}: n_spatial_dims={self.n_spatial} but dimensions/spatial_dims lists "
                f"{self.spatial_dims}; need 1-3 spatial axes"
            )
        for axis in self.spatial_dims:
            _plain_name(axis, p, "dimensions/spatial_dims")
        if len(set(self.spatial_dims)) != len(self.spatial_dims):
            raise ValueError(f"{p}: dimensions/spatial_dims repeats an axis: {self.spatial_dims}")
        for key in ("time", *self.spatial_dims):
            if key not in dims:
                raise ValueError(f"{p}: dataset 'dimensions/{key}' is missing")
        self.time = self._read_time(_member(dims, "time", p))
        self.n_time = int(self.time.shape[-1])
        self.coords: dict[str, np.ndarray] = {}
        for axis in self.spatial_dims:
            ds = _member(dims, axis, p)
            if ds.dtype.kind not in "fiu":
                raise ValueError(
                    f"{p}: dimensions/{axis} has dtype {ds.dtype}; coordinates must be real numbers"
                )
            coord = _read_whole(ds, p)
            if coord.ndim < 1 or coord.shape[-1] < 1:
                raise ValueError(
                    f"{p}: dimensions/{axis} has shape {coord.shape}; need one coordinate per "
                    "grid point"
                )
            self.coords[axis] = coord
        self.spatial_shape = tuple(int(self.coords[a].shape[-1]) for a in self.spatial_dims)

        self.bcs = self._read_bcs(_group(f, "boundary_conditions", p))
        self.scalars: dict[str, np.ndarray] = {}
        if "scalars" in f:
            group = _group(f, "scalars", p)
            for key in _as_strs(group.attrs.get("field_names", [])):
                _plain_name(key, p, "scalars/field_names")
                if key in group:
                    self.scalars[key] = _read_whole(_member(group, key, p), p)

        self.fields: list[FieldInfo] = []
        for rank, gname in enumerate(FIELD_GROUPS):
            if gname not in f:
                continue
            g = _group(f, gname, p)
            for field in _as_strs(_attr(g, "field_names", p)):
                _plain_name(field, p, f"{gname}/field_names")
                if field not in g:
                    raise ValueError(
                        f"{p}: field {field!r} is listed in {gname}/field_names but missing"
                    )
                self.fields.append(self._field_info(_member(g, field, p), gname, field, rank))
        if not self.fields:
            raise ValueError(f"{p}: no fields in t0_fields/t1_fields/t2_fields")
        self.field_names = [c for fi in self.fields for c in fi.components]
        if len(set(self.field_names)) != len(self.field_names):
            raise ValueError(f"{p}: duplicate field component names {self.field_names}")

    def _read_time(self, ds: h5py.Dataset) -> np.ndarray:
        """The time coordinate as float64: real, finite and strictly increasing, bounded in size."""
        p = self.path
        if ds.dtype.kind not in "fiu":
            raise ValueError(
                f"{p}: dimensions/time has dtype {ds.dtype}; time must be real numbers"
            )
        shape = ds.shape or ()
        if len(shape) == 0:
            raise ValueError(f"{p}: dimensions/time is a scalar; need one time per frame")
        if len(shape) > 2 or (len(shape) == 2 and shape[0] != self.n_trajectories):
            raise ValueError(
                f"{p}: dimensions/time has shape {shape}; need (n_time,) or (n_trajectories="
                f"{self.n_trajectories}, n_time)"
            )
        if shape[-1] < 1:
            raise ValueError(f"{p}: dimensions/time is empty; need one time per frame")
        time = np.asarray(_read_whole(ds, p), dtype=np.float64)  # (n_time,) or (n_traj, n_time)
        bad = np.flatnonzero(~np.isfinite(time.reshape(-1)))
        if bad.size:
            where = np.unravel_index(bad[0], time.shape)
            raise ValueError(
                f"{p}: dimensions/time holds NaN or Inf ({bad.size} of {time.size} "
                f"values, the first at index {tuple(int(i) for i in where)})"
            )
        steps = np.diff(time, axis=-1)
        bad = np.flatnonzero(steps.reshape(-1) <= 0)
        if bad.size:
            where = np.unravel_index(bad[0], steps.shape)
            i = tuple(int(k) for k in where)
            j = (*i[:-1], i[-1] + 1)
            raise ValueError(
                f"{p}: dimensions/time does not increase: time{list(i)} = {time[i]!r} then "
                f"time{list(j)} = {time[j]!r}; times must increase strictly (no repeats)"
            )
        return time

    def _read_bcs(self, group: h5py.Group) -> np.ndarray:
        """Boundary type of each axis side, by the rules The Well's own reader applies.

        A side that no group marks is open. A group's ``mask`` spans its ``associated_dims`` in
        that order (or every spatial axis), with one entry per grid point of each; on a side of
        one of those axes the group applies if any of its mask there is set, or, for a wall, if
        all of it is. Groups are applied in the file's group order, a later one replacing an
        earlier one on the sides it marks. A group over several axes gets The Well's warning
        that only axis-aligned boundaries are exact. A group without a mask (or with a 0-d
        one) covers both sides of its axes.
        """
        p = self.path
        bcs = np.full((self.n_spatial, 2), int(BoundaryType.OPEN), dtype=np.int64)
        for gname in group:
            link = group.get(gname, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                raise ValueError(
                    f"{p}: boundary_conditions/{gname} is a link to another file; walrus reads "
                    "only data stored in the file itself"
                )
            g = group.get(gname)
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
            if len(set(dims)) != len(dims):
                raise ValueError(f"{where}: associated_dims repeats an axis: {dims}")
            if len(dims) > 1:
                warnings.warn(
                    f"{where} spans axes {dims}: only axis-aligned boundaries are exact; each "
                    "side counts as open or periodic if any of the mask there is, wall only if "
                    "all of it is",
                    RuntimeWarning,
                    stacklevel=2,
                )
            has_mask = "mask" in g
            if has_mask:
                ds = _member(g, "mask", p)
                if ds.dtype.kind not in "biuf":
                    raise ValueError(
                        f"{where}: mask has dtype {ds.dtype}; a mask holds booleans (or 0/1)"
                    )
                mask = np.asarray(_read_whole(ds, p), dtype=bool)
            else:
                mask = np.ones((), bool)
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
            if has_mask and mask.ndim > 0:
                want = tuple(self.spatial_shape[self.spatial_dims.index(a)] for a in mask_axes)
                if mask.shape != want:
                    raise ValueError(
                        f"{where}: mask has shape {mask.shape}, but axes {mask_axes} have "
                        f"{want} grid points"
                    )
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
        time_varying = _bool_attr(ds, "time_varying", p, True)
        sample_varying = _bool_attr(ds, "sample_varying", p, True)
        raw = np.atleast_1d(np.asarray(ds.attrs.get("dim_varying", [True] * d)))
        if raw.dtype.kind not in "biu" or raw.ndim != 1 or not np.isin(raw, (0, 1)).all():
            raise ValueError(
                f"{p}: field {group}/{name} has dim_varying {ds.attrs['dim_varying']!r:.60}; "
                f"need {d} booleans"
            )
        dim_varying = tuple(bool(v) for v in raw)
        if len(dim_varying) != d:
            raise ValueError(
                f"{p}: field {name!r} has dim_varying of length {len(dim_varying)}, expected {d}"
            )
        lead = ((self.n_trajectories,) if sample_varying else ()) + (
            (self.n_time,) if time_varying else ()
        )
        lead += tuple(n for n, v in zip(self.spatial_shape, dim_varying) if v)
        shape = tuple(ds.shape or ())
        flat = False
        if shape == lead + (d,) * rank:
            pass
        elif rank == 2 and shape == lead + (d * d,):
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
        return FieldInfo(
            name,
            group,
            rank,
            comps,
            time_varying,
            sample_varying,
            dim_varying,
            flat,
            shape,
            ds.dtype.itemsize,
        )

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

    def check_read_size(
        self,
        selection: list[tuple[FieldInfo, list[int]]],
        n_frames: int,
        max_bytes: int | None = None,
    ) -> None:
        """Refuse a read of ``n_frames`` frames of ``selection`` needing more than ``max_bytes``
        (``None``: :func:`walrus.memory.default_max_sample_bytes`, a share of the memory
        available).

        Counts the float32 result and the largest single field read (all its components, in
        the stored dtype), from declared shapes only; nothing is allocated.
        """
        if max_bytes is None:
            max_bytes = default_max_sample_bytes()
        n_pts = math.prod(self.spatial_shape)
        n_chan = sum(len(comps) for _, comps in selection)
        out_bytes = n_frames * n_chan * n_pts * 4
        field_bytes = max(
            (
                (n_frames if fi.time_varying else 1)
                * math.prod(n for n, v in zip(self.spatial_shape, fi.dim_varying) if v)
                * len(fi.components)
                * fi.itemsize
                for fi, _ in selection
            ),
            default=0,
        )
        if out_bytes + field_bytes > max_bytes:
            raise ValueError(
                f"{self.path}: reading {n_frames} frames of {n_chan} channels on a "
                f"{'x'.join(map(str, self.spatial_shape))} grid needs "
                f"{(out_bytes + field_bytes) / 2**30:.3g} GiB, over data.max_sample_bytes="
                f"{max_bytes} ({max_bytes / 2**30:.3g} GiB); raise that option if this is meant"
            )

    def _dataset(self, handle: h5py.File, fi: FieldInfo) -> h5py.Dataset:
        """Field ``fi`` in an open ``handle``, checked again: the file may have changed since."""
        ds = _member(_member(handle, fi.group, self.path, h5py.Group), fi.name, self.path)
        if tuple(ds.shape or ()) != fi.shape:
            raise ValueError(
                f"{self.path}: field {fi.group}/{fi.name} now has shape {ds.shape}, not "
                f"{fi.shape} as when the file was opened (was it rewritten?)"
            )
        return ds

    def read(
        self,
        handle: h5py.File,
        selection: list[tuple[FieldInfo, list[int]]],
        trajectory: int,
        start: int,
        n_frames: int,
        stride: int = 1,
        check_finite: bool = True,
        max_bytes: int | None = None,
    ) -> np.ndarray:
        """Read frames ``start, start+stride, ...`` (``n_frames`` of them) of one trajectory.

        Only those frames are read. A read needing more than ``max_bytes`` is refused before
        anything is allocated; values beyond float32's range are an error, not Inf.

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
        self.check_read_size(selection, n_frames, max_bytes)
        n_chan = sum(len(comps) for _, comps in selection)
        out = np.empty((n_frames, n_chan, *self.spatial_shape), dtype=np.float32)
        c0 = 0
        for fi, comps in selection:
            ds_name = f"{fi.group}/{fi.name}"
            idx: tuple[Any, ...] = ()
            if fi.sample_varying:
                idx += (trajectory,)
            if fi.time_varying:
                idx += (slice(start, stop, stride),)
            ds = self._dataset(handle, fi)
            if ds.size and not ds.id.get_storage_size():
                raise ValueError(
                    f"{p}: field {ds_name!r} declares {ds.size:,} values "
                    f"({'x'.join(map(str, ds.shape))}) but none was ever written (an empty "
                    "or crafted file?)"
                )
            try:
                arr = ds[idx] if idx else ds[()]
            except (OSError, KeyError, RuntimeError, ValueError) as e:
                raise ValueError(
                    f"{p}: cannot read field {ds_name!r} at trajectory {trajectory}, "
                    f"time {start}:{stop}:{stride} (corrupt or truncated file?): {_one_line(e)}"
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
            block = np.moveaxis(arr[..., comps], -1, 1)  # (T or 1, k, *spatial or 1s)
            try:
                with np.errstate(over="raise"):
                    out[:, c0 : c0 + len(comps)] = block
            except FloatingPointError:
                raise ValueError(
                    f"{p}: field {ds_name!r} holds values out of float32 range (|x| > "
                    f"{float(np.finfo(np.float32).max):.4g}) at trajectory {trajectory}, time "
                    f"{start}:{stop}:{stride}; walrus computes in float32"
                ) from None
            c0 += len(comps)
        if check_finite and not np.isfinite(out).all():
            bad_t, bad_c = np.nonzero(~np.isfinite(out).reshape(n_frames, n_chan, -1).all(-1))
            names = [fi.components[c] for fi, comps in selection for c in comps]
            raise ValueError(
                f"{p}: NaN or Inf in field {names[bad_c[0]]!r}, trajectory {trajectory}, "
                f"time index {start + bad_t[0] * stride}"
            )
        return out


def list_split_files(root: str | os.PathLike, dataset: str, split: str) -> list[Location]:
    """Sorted ``{root}/{dataset}/data/{split}/*.hdf5`` files; a missing directory or none is an error.

    ``root`` is a local folder (files come back as ``Path``) or an fsspec URL (files come back
    as URLs under it); both are listed through fsspec.
    """
    root = as_location(root)
    if not data_root_exists(root):
        raise FileNotFoundError(f"data root {root} does not exist (or is not a directory)")
    ddir = join(root, dataset)
    if not is_dir(ddir):
        available = list_folders(root)
        found = "its folder cannot be listed" if available is None else f"found: {available}"
        raise FileNotFoundError(f"dataset directory {ddir} does not exist ({found})")
    sdir = join(ddir, "data", split)
    if not is_dir(sdir):
        raise FileNotFoundError(
            f"split directory {sdir} does not exist (expected data/{{train,valid,test}})"
        )
    files = [
        join(sdir, n)
        for n, _ in list_dir(sdir)
        if n.endswith((".hdf5", ".h5")) and not n.startswith(".")
    ]
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
        path: the ``.hdf5`` file (local path or fsspec URL).
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
