"""Read The Well's HDF5 files lazily into windows of frames.

A dataset directory is ``{root}/{dataset}/data/{split}/*.hdf5`` (the layout of a real Well
download). Each file holds ``n_trajectories`` trajectories of ``n_time`` frames; a sample is a
window of ``n_steps_input + n_steps_output`` frames, ``time_stride`` apart, from one trajectory.

Vector (t1) and tensor (t2) fields are flattened into named components: ``velocity`` on axes
``x, y`` becomes ``velocity_x, velocity_y``; ``stress`` becomes ``stress_xx, stress_xy, ...``.
Fields constant in time, shared across trajectories, or constant along an axis are broadcast.

Shape legend: T time, C channels (field components), S spatial axes (1-3).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from walrus.bcs import BoundaryType
from walrus.data.batch import Batch
from walrus.data.vocab import FieldVocabulary

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
    """Open an HDF5 file read-only; a non-HDF5 or truncated file raises ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return h5py.File(path, "r")
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
        self.time = np.asarray(dims["time"][()], dtype=np.float64)
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

    def _read_bcs(self, group: h5py.Group) -> np.ndarray:
        p = self.path
        bcs = np.full((self.n_spatial, 2), -1, dtype=np.int64)
        for gname, g in group.items():
            if not isinstance(g, h5py.Group):
                continue
            try:
                bc = BoundaryType.parse(_as_str(_attr(g, "bc_type", p)))
            except ValueError as e:
                raise ValueError(f"{p}: boundary_conditions/{gname}: {e}") from None
            mask = np.asarray(g["mask"][()], dtype=bool) if "mask" in g else None
            for dim in _as_strs(_attr(g, "associated_dims", p)):
                if dim not in self.spatial_dims:
                    raise ValueError(
                        f"{p}: boundary_conditions/{gname} names axis {dim!r}, "
                        f"not one of {self.spatial_dims}"
                    )
                ax = self.spatial_dims.index(dim)
                if mask is None or mask.ndim == 0 or mask.size == 0:
                    lo = hi = True
                else:
                    m = mask
                    if m.ndim == self.n_spatial and m.ndim > 1:
                        other = tuple(i for i in range(m.ndim) if i != ax)
                        m = m.any(axis=other)
                    m = m.reshape(-1)
                    lo, hi = bool(m[0]), bool(m[-1])
                for side, on in ((0, lo), (1, hi)):
                    if on and bcs[ax, side] < 0:
                        bcs[ax, side] = int(bc)
        for ax, side in zip(*np.nonzero(bcs < 0)):
            raise ValueError(
                f"{p}: no boundary condition for axis {self.spatial_dims[ax]!r} "
                f"({'lo' if side == 0 else 'hi'} side) in boundary_conditions"
            )
        return bcs

    def _field_info(self, ds: h5py.Dataset, group: str, name: str, rank: int) -> FieldInfo:
        p, d = self.path, self.n_spatial
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


def _stride_range(time_stride: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(time_stride, int):
        lo = hi = time_stride
    else:
        vals = list(time_stride)
        if len(vals) != 2:
            raise ValueError(f"time_stride must be an int or a (lo, hi) pair, got {time_stride!r}")
        lo, hi = int(vals[0]), int(vals[1])
    if lo < 1 or hi < lo:
        raise ValueError(f"time_stride must be >= 1 with lo <= hi, got {time_stride!r}")
    return lo, hi


class WellDataset(Dataset):
    """Windows of frames from one Well dataset split, read lazily.

    Args:
        root: folder holding ``{dataset}/data/{split}/*.hdf5``.
        dataset: dataset folder name (e.g. ``navier_stokes_2d``, ``turbulent_radiative_layer_2D``).
        split: ``train``, ``valid`` or ``test``.
        n_steps_input: input frames per window.
        n_steps_output: target frames per window.
        time_stride: frames between consecutive window frames; an ``(lo, hi)`` pair draws the
            stride per sample when ``train`` (else ``lo`` is used). Windows are indexed at
            ``lo``; a drawn stride is capped so the window still fits the trajectory.
        vocab: field vocabulary giving ``field_ids``; default: one built from this dataset.
        fields: channel subset (component names like ``velocity_x`` or whole fields like
            ``velocity``); default all.
        train: draw strides from the range.
        check_finite: raise on NaN/Inf in a window.

    Each item is a ``Batch`` with a leading batch axis of 1: ``input_fields (1, T_in, C, *S)``,
    ``output_fields (1, T_out, C, *S)``.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        dataset: str,
        split: str = "train",
        n_steps_input: int = 4,
        n_steps_output: int = 1,
        time_stride: int | Sequence[int] = 1,
        vocab: FieldVocabulary | None = None,
        fields: Sequence[str] | None = None,
        train: bool = False,
        check_finite: bool = True,
    ) -> None:
        if n_steps_input < 1 or n_steps_output < 0:
            raise ValueError(
                f"need n_steps_input >= 1 and n_steps_output >= 0, got {n_steps_input}, {n_steps_output}"
            )
        self.root, self.dataset, self.split = Path(root), dataset, split
        self.n_steps_input, self.n_steps_output = n_steps_input, n_steps_output
        self.stride_lo, self.stride_hi = _stride_range(time_stride)
        self.train, self.check_finite = train, check_finite
        self.files = [WellFile(p) for p in list_split_files(root, dataset, split)]
        first = self.files[0]
        for wf in self.files[1:]:
            if wf.field_names != first.field_names or wf.spatial_shape != first.spatial_shape:
                raise ValueError(
                    f"{wf.path}: fields {wf.field_names} / shape {wf.spatial_shape} differ from "
                    f"{first.path} ({first.field_names} / {first.spatial_shape})"
                )
            if not np.array_equal(wf.bcs, first.bcs):
                raise ValueError(f"{wf.path}: boundary conditions differ from {first.path}")
        self.selections = [wf.select(fields) for wf in self.files]
        self.field_names = [fi.components[c] for fi, comps in self.selections[0] for c in comps]
        self.vocab = vocab if vocab is not None else FieldVocabulary(self.field_names)
        self.field_ids = self.vocab.ids(self.field_names)  # (C,)
        self.bcs = torch.from_numpy(first.bcs.copy())  # (S, 2)
        self.spatial_shape = first.spatial_shape
        self.n_spatial = first.n_spatial

        span = (self.window_length - 1) * self.stride_lo + 1
        self._windows_per_traj = []
        for wf in self.files:
            n = wf.n_time - span + 1
            if n < 1:
                raise ValueError(
                    f"{wf.path}: a window of {self.window_length} frames at time stride "
                    f"{self.stride_lo} spans {span} time steps, longer than the trajectory "
                    f"({wf.n_time} steps)"
                )
            self._windows_per_traj.append(n)
        counts = [wf.n_trajectories * n for wf, n in zip(self.files, self._windows_per_traj)]
        self._offsets = np.cumsum([0, *counts]).tolist()
        traj_counts = [wf.n_trajectories for wf in self.files]
        self._traj_offsets = np.cumsum([0, *traj_counts]).tolist()
        self._handles: dict[Path, h5py.File] = {}
        self._pid = os.getpid()

    @property
    def window_length(self) -> int:
        return self.n_steps_input + self.n_steps_output

    @property
    def n_trajectories(self) -> int:
        return self._traj_offsets[-1]

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state

    def _handle(self, path: Path) -> h5py.File:
        # one handle per process: a DataLoader worker opens its own after the fork
        pid = os.getpid()
        if pid != self._pid:
            self._handles, self._pid = {}, pid
        h = self._handles.get(path)
        if h is None:
            h = self._handles[path] = open_h5(path)
        return h

    def close(self) -> None:
        """Close this process's open file handles."""
        if self._pid == os.getpid():
            for h in self._handles.values():
                h.close()
        self._handles = {}

    def locate(self, index: int) -> tuple[int, int, int]:
        """``(file index, trajectory in file, start time index)`` of window ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        k = bisect.bisect_right(self._offsets, index) - 1
        local = index - self._offsets[k]
        traj, start = divmod(local, self._windows_per_traj[k])
        return k, traj, start

    def _dt(self, wf: WellFile, traj: int, start: int, stride: int) -> float:
        t = wf.time if wf.time.ndim == 1 else wf.time[traj]
        return float(t[start + stride] - t[start]) if start + stride < wf.n_time else float("nan")

    def __getitem__(self, index: int) -> Batch:
        k, traj, start = self.locate(index)
        wf = self.files[k]
        stride = self.stride_lo
        if self.train and self.stride_hi > self.stride_lo and self.window_length > 1:
            stride = int(torch.randint(self.stride_lo, self.stride_hi + 1, ()).item())
            stride = min(stride, (wf.n_time - 1 - start) // (self.window_length - 1))
        return self._read_batch(k, traj, start, self.window_length, stride)

    def _read_batch(self, k: int, traj: int, start: int, n: int, stride: int) -> Batch:
        """``n`` frames of trajectory ``traj`` of file ``k`` from ``start``, as a B=1 batch."""
        wf = self.files[k]
        frames = wf.read(
            self._handle(wf.path), self.selections[k], traj, start, n, stride, self.check_finite
        )  # (T, C, *S)
        x = torch.from_numpy(frames)[None]  # (1, T, C, *S)
        return Batch(
            input_fields=x[:, : self.n_steps_input],
            output_fields=x[:, self.n_steps_input :],
            field_ids=self.field_ids,
            bcs=self.bcs,
            metadata={
                "dataset": self.dataset,
                "field_names": tuple(self.field_names),
                "trajectory": torch.tensor([self._traj_offsets[k] + traj]),
                "start": torch.tensor([start]),
                "stride": torch.tensor([stride]),
                "dt": torch.tensor([self._dt(wf, traj, start, stride)], dtype=torch.float64),
                "file": [str(wf.path)],
            },
        )

    def trajectory(
        self, index: int, stride: int | None = None, n_frames: int | None = None
    ) -> Batch:
        """A whole trajectory for rollout: the first ``n_steps_input`` frames as input, the rest as target.

        Args:
            index: trajectory index over all files of the split, in ``[0, n_trajectories)``.
            stride: time stride (default: the dataset's ``lo`` stride).
            n_frames: total frames to read (default: as many as fit).

        Returns:
            A ``Batch`` with ``input_fields (1, T_in, C, *S)`` and ``output_fields (1, T_rest, C, *S)``.
        """
        if not 0 <= index < self.n_trajectories:
            raise IndexError(
                f"trajectory {index} out of range for {self.n_trajectories} trajectories"
            )
        k = bisect.bisect_right(self._traj_offsets, index) - 1
        wf, traj = self.files[k], index - self._traj_offsets[k]
        stride = stride or self.stride_lo
        fit = (wf.n_time - 1) // stride + 1
        n = fit if n_frames is None else n_frames
        if n > fit or n <= self.n_steps_input:
            raise ValueError(
                f"{wf.path}: trajectory {traj} has {fit} frames at stride {stride}; asked for {n} "
                f"(need more than n_steps_input={self.n_steps_input})"
            )
        return self._read_batch(k, traj, 0, n, stride)


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
