"""Windows of frames from one Well dataset split, read lazily (the file format is ``well_file``).

A sample is a window of ``n_steps_input + n_steps_output`` frames, ``time_stride`` apart, from
one trajectory; ``WellDataset.trajectory`` reads frames of a whole trajectory for rollouts.

Shape legend: T time, C channels (field components), S spatial axes (1-3).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from walrus.data.batch import Batch
from walrus.data.storage import Location, as_location, join
from walrus.data.vocab import FieldVocabulary
from walrus.data.well_file import WellFile, list_split_files, open_h5
from walrus.memory import default_max_sample_bytes

# Windows one split may hold: samplers build an index list per epoch, so more is refused.
MAX_WINDOWS = 10**8


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
        root: folder holding ``{dataset}/data/{split}/*.hdf5``: a local path or an fsspec URL
            (``memory://...``, ``file://...``, ``hf://datasets/polymathic-ai/``).
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
        max_sample_bytes: most bytes one read (a window, or a rollout's frames) may need; a
            file whose windows need more is refused when the dataset is opened (``None``: the
            default, 8 GiB).
        trajectories: serve only the first this many trajectories of the split, in file order
            (files sorted by name, trajectories in file order); ``None``: all.

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
        max_sample_bytes: int | None = None,
        trajectories: int | None = None,
    ) -> None:
        if n_steps_input < 1 or n_steps_output < 0:
            raise ValueError(
                f"need n_steps_input >= 1 and n_steps_output >= 0, got {n_steps_input}, {n_steps_output}"
            )
        if max_sample_bytes is None:
            max_sample_bytes = default_max_sample_bytes()
        if (
            isinstance(max_sample_bytes, bool)
            or not isinstance(max_sample_bytes, int)
            or max_sample_bytes < 1
        ):
            raise ValueError(
                f"data.max_sample_bytes must be a positive integer, got {max_sample_bytes!r}"
            )
        self.root, self.dataset, self.split = as_location(root), dataset, split
        self.max_sample_bytes = max_sample_bytes
        self.n_steps_input, self.n_steps_output = n_steps_input, n_steps_output
        self.stride_lo, self.stride_hi = _stride_range(time_stride)
        self.train, self.check_finite = train, check_finite
        self.files = [WellFile(p) for p in list_split_files(root, dataset, split)]
        traj_counts = [wf.n_trajectories for wf in self.files]
        if trajectories is not None:
            traj_counts = _first_trajectories(traj_counts, trajectories, dataset, split)
            self.files = self.files[: len(traj_counts)]
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
        for wf, sel in zip(self.files, self.selections):
            wf.check_read_size(sel, self.window_length, self.max_sample_bytes)
        counts = [t * n for t, n in zip(traj_counts, self._windows_per_traj)]
        if sum(counts) > MAX_WINDOWS:
            raise ValueError(
                f"{join(self.root, dataset, 'data', split)}: the files declare {sum(counts):,} "
                f"windows, more than the {MAX_WINDOWS:,} one split may hold"
            )
        self._offsets = np.cumsum([0, *counts]).tolist()
        self._traj_offsets = np.cumsum([0, *traj_counts]).tolist()
        self._handles: dict[Location, h5py.File] = {}
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

    def _handle(self, path: Location) -> h5py.File:
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
            self._handle(wf.path),
            self.selections[k],
            traj,
            start,
            n,
            stride,
            self.check_finite,
            self.max_sample_bytes,
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

    def locate_trajectory(self, index: int) -> tuple[int, int]:
        """``(file index, trajectory in that file)`` of split-wide trajectory ``index``."""
        if not 0 <= index < self.n_trajectories:
            raise IndexError(
                f"trajectory {index} out of range for {self.n_trajectories} trajectories"
            )
        k = bisect.bisect_right(self._traj_offsets, index) - 1
        return k, index - self._traj_offsets[k]

    def frames_available(self, index: int, stride: int | None = None) -> int:
        """Frames of trajectory ``index`` at time stride ``stride`` (default: the ``lo`` stride)."""
        k, _ = self.locate_trajectory(index)
        return (self.files[k].n_time - 1) // (stride or self.stride_lo) + 1

    def trajectory(
        self, index: int, stride: int | None = None, n_frames: int | None = None, start: int = 0
    ) -> Batch:
        """Frames of one trajectory for rollout: the first ``n_steps_input`` as input, the rest as target.

        Only the requested frames are read from the file.

        Args:
            index: trajectory index over all files of the split, in ``[0, n_trajectories)``.
            stride: time stride (default: the dataset's ``lo`` stride).
            n_frames: total frames to read (default: as many as fit after ``start``).
            start: first frame, counted at ``stride`` (time index ``start * stride``).

        Returns:
            A ``Batch`` with ``input_fields (1, T_in, C, *S)`` and ``output_fields (1, T_rest, C, *S)``;
            its ``metadata['start']`` is the time index of the first frame.
        """
        k, traj = self.locate_trajectory(index)
        wf = self.files[k]
        stride = stride or self.stride_lo
        fit = (wf.n_time - 1) // stride + 1 - start
        n = fit if n_frames is None else n_frames
        if start < 0 or n > fit or n <= self.n_steps_input:
            raise ValueError(
                f"{wf.path}: trajectory {traj} has {fit + start} frames at stride {stride}; asked "
                f"for {n} from frame {start} (need more than n_steps_input={self.n_steps_input})"
            )
        return self._read_batch(k, traj, start * stride, n, stride)


def _first_trajectories(counts: Sequence[int], n: int, dataset: str, split: str) -> list[int]:
    """Trajectories taken from each file (``counts``: each file's) to serve the first ``n``;
    files past the ``n``-th trajectory are left off the list.

    Raises:
        ValueError: ``n`` is below 1 or more than the split holds (one line naming
            ``data.train_trajectories``).
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= sum(counts):
        raise ValueError(
            f"data.train_trajectories={n!r}: the {split} split of {dataset} holds {sum(counts)} "
            f"trajectories; give a whole number from 1 to {sum(counts)}, or null for all"
        )
    taken: list[int] = []
    for c in counts:
        if n <= 0:
            break
        taken.append(min(c, n))
        n -= taken[-1]
    return taken


def evenly_spaced(n: int, k: int | None) -> list[int]:
    """``k`` evenly spaced indices of ``range(n)``, first and last included; all when ``k`` is None or >= n."""
    if k is None or n <= k:
        return list(range(n))
    return np.unique(np.linspace(0, n - 1, k).round().astype(int)).tolist()
