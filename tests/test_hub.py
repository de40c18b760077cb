"""Hub checkpoints (``hf://``, ``walrus.from_pretrained``) from a local cache in the Hub's own
layout, the conversion kept in that cache, offline use, one-line errors, and a local
``walrus.pt`` picking up the ``extended_config.yaml`` beside it. Nothing is downloaded."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import walrus
from tests.conftest import tiny_train_overrides
from walrus import hub
from walrus.checkpoint import load_checkpoint_file, load_model
from walrus.compat.__main__ import main as convert_main
from walrus.compat.released import RELEASED_FIELDS
from walrus.data.writer import write_well_file

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
CURRENT = FIXTURES / "walrus_current_tiny2d.pt"
CURRENT_JSON = FIXTURES / "walrus_current_tiny2d.json"
needs_fixture = pytest.mark.skipif(
    not (CURRENT.is_file() and CURRENT_JSON.is_file()),
    reason=f"reference fixture {CURRENT} not found (../shared next to repo)",
)
REPO_ID = "polymathic-ai/walrus"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# The fixture's 8 vocabulary slots, named after released fields (as in test_compat_current).
FIELDS = list(RELEASED_FIELDS[:6]) + ["density", "energy"]


@pytest.fixture(scope="module")
def fixture() -> dict:
    return torch.load(CURRENT, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory, fixture: dict) -> dict[str, bytes]:
    """The files of a released-layout repo: weights under ['app']['model'] and the config."""
    tmp = tmp_path_factory.mktemp("released")
    torch.save({"app": {"model": fixture["state_dict"]}}, tmp / "walrus.pt")
    model = json.loads(CURRENT_JSON.read_text())["model"]
    config = {
        "model": model,
        "data": {"field_index_map_override": {n: i for i, n in enumerate(FIELDS)}},
    }
    return {
        "walrus.pt": (tmp / "walrus.pt").read_bytes(),
        "extended_config.yaml": yaml.safe_dump(config).encode(),
    }


def add_to_cache(
    cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT, refs=("main",)
) -> Path:
    """Write ``files`` into a Hub cache as huggingface_hub lays it out; returns the repo folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache under HF_HOME, with HF_HUB_OFFLINE=1."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf_home" / "hub"


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max()).item()


# ------------------------------------------------------------------------------------- grammar


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("hf://polymathic-ai/walrus", (REPO_ID, "walrus.pt", "main")),
        ("hf://polymathic-ai/walrus@v1.0", (REPO_ID, "walrus.pt", "v1.0")),
        ("hf://org/name/fine/ns.pt", ("org/name", "fine/ns.pt", "main")),
        ("hf://org/name/fine/ns.pt@refs/pr/3", ("org/name", "fine/ns.pt", "refs/pr/3")),
        (f"hf://org/name@{COMMIT}", ("org/name", "walrus.pt", COMMIT)),
    ],
)
def test_url_grammar(url: str, expected: tuple[str, str, str]) -> None:
    ref = hub.parse_hub_url(url)
    assert (ref.repo_id, ref.filename, ref.revision) == expected
    assert hub.parse_hub_url(ref.url) == ref  # the canonical URL reads back


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("hf://walrus", "ORG/NAME"),
        ("hf://org/name@", "ORG/NAME"),
        ("hf://datasets/polymathic-ai/the_well", "model repos"),
        ("hf://org/bad name", "must be ORG/NAME"),
        ("hf://org/name/../x.pt", "path inside the repo"),
        ("hf://org/name@has space", "branch, tag or commit"),
    ],
)
def test_bad_urls_are_one_line_errors(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        hub.parse_hub_url(url)
    assert "\n" not in str(info.value)


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub.hub_cache_dir() == tmp_path / "cache"


# ---------------------------------------------------------------------------- cache, offline


@needs_fixture
def test_from_pretrained_offline_converts_once_into_the_cache(
    offline_cache: Path, released: dict[str, bytes], fixture: dict, monkeypatch
) -> None:
    repo = add_to_cache(offline_cache, REPO_ID, released)
    loaded = walrus.from_pretrained(REPO_ID)
    assert isinstance(loaded, walrus.InferenceCheckpoint)
    assert loaded.vocab.names == FIELDS  # field names from the snapshot's extended_config.yaml
    assert not loaded.model.training and loaded.predict_delta
    assert type(loaded.normalizer).__name__ == "MeanStdNormalizer"
    assert loaded.source == f"hf://{REPO_ID}/walrus.pt@main"
    x = fixture["x"].transpose(0, 1)  # (B, T, C, H, W)
    with torch.no_grad():
        y = loaded.model(x, fixture["state_labels"], fixture["bcs"][0]).transpose(0, 1)
    assert rel(y, fixture["y"]) < 1e-5
    # keyed by the blobs the snapshot links to: weights, then config
    blobs = [os.path.basename(os.path.realpath(repo / "snapshots" / COMMIT / n)) for n in released]
    converted = repo / hub.CONVERTED_DIR / f"{blobs[0]}-{blobs[1]}.ckpt"
    assert loaded.path == converted and converted.is_file()
    assert load_checkpoint_file(converted)["walrus"]["source"]["hub"]["commit"] == COMMIT

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(hub, "convert_state_dict", no_conversion)
    monkeypatch.setattr(hub, "read_official_file", no_conversion)
    again = walrus.load(f"hf://{REPO_ID}")
    assert again.path == converted and again.vocab.names == FIELDS
    for a, b in zip(again.model.state_dict().values(), loaded.model.state_dict().values()):
        assert torch.equal(a, b)


@needs_fixture
def test_revisions_by_ref_and_by_commit_hash(
    offline_cache: Path, released: dict[str, bytes]
) -> None:
    other = "f" * 40
    files = {"walrus.pt": released["walrus.pt"]}  # no config: the converter's defaults
    add_to_cache(offline_cache, REPO_ID, files, commit=other, refs=("v2",))
    by_tag = walrus.from_pretrained(REPO_ID, revision="v2")
    assert by_tag.vocab.names[3] == "official_field_3"  # placeholders without a config
    by_hash = walrus.load(f"hf://{REPO_ID}@{other}")  # a commit hash needs no refs/
    assert by_hash.path == by_tag.path
    with pytest.raises(FileNotFoundError, match="not in the Hub cache") as info:
        walrus.from_pretrained(REPO_ID)  # refs/main missing: main is not cached
    msg = str(info.value)
    assert "\n" not in msg and "revision main" in msg and "HF_HUB_OFFLINE is set" in msg


@needs_fixture
def test_fine_tune_in_a_subfolder_with_its_own_config(
    offline_cache: Path, released: dict[str, bytes]
) -> None:
    files = {f"finetunes/ns/{n}": data for n, data in released.items()}
    add_to_cache(offline_cache, "org/ft", files)
    loaded = walrus.from_pretrained("org/ft", filename="finetunes/ns/walrus.pt")
    assert loaded.vocab.names == FIELDS
    assert loaded.path.parent == offline_cache / "models--org--ft" / hub.CONVERTED_DIR


@needs_fixture
def test_cache_without_links_is_keyed_by_commit(
    offline_cache: Path, released: dict[str, bytes]
) -> None:
    snapshot = offline_cache / "models--org--copies" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "walrus.pt").write_bytes(released["walrus.pt"])  # a copy, as without symlinks
    loaded = walrus.load(f"hf://org/copies@{COMMIT}")
    assert loaded.path.name == f"{COMMIT}-walrus.pt.ckpt"


def test_offline_and_not_cached(offline_cache: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        walrus.from_pretrained("org/absent", filename="w.pt", revision="v1")
    msg = str(info.value)
    assert "\n" not in msg and "not in the Hub cache" in msg
    assert all(part in msg for part in ("org/absent", "w.pt", "v1", str(offline_cache)))


def _http_error(cls: type, url: str) -> Exception:
    import httpx2

    response = httpx2.Response(404, request=httpx2.Request("GET", url))
    return cls("404 Client Error", response=response)


@pytest.mark.parametrize(
    ("error", "kind", "match"),
    [
        ("RepositoryNotFoundError", FileNotFoundError, "no such model repo"),
        ("GatedRepoError", ValueError, "gated"),
        ("RevisionNotFoundError", ValueError, "has no revision 'v9'"),
        ("RemoteEntryNotFoundError", FileNotFoundError, "has no such file"),
        ("LocalEntryNotFoundError", FileNotFoundError, "could not be reached"),
    ],
)
def test_hub_errors_become_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: str, kind: type, match: str
) -> None:
    import huggingface_hub
    from huggingface_hub import errors

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    seen = {}

    def answer(repo_id, filename, *, revision, cache_dir, local_files_only):
        seen.update(repo_id=repo_id, cache_dir=cache_dir, local_files_only=local_files_only)
        cls = getattr(errors, error)
        if issubclass(cls, errors.HfHubHTTPError):
            raise _http_error(
                cls, f"https://huggingface.co/{repo_id}/resolve/{revision}/{filename}"
            )
        raise cls("no connection and not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", answer)
    with pytest.raises(kind, match=match) as info:
        walrus.load("hf://org/name/w.pt@v9")
    assert "\n" not in str(info.value) and "org/name" in str(info.value)
    assert seen == {"repo_id": "org/name", "cache_dir": tmp_path, "local_files_only": False}


# ---------------------------------------------------------------------- local walrus.pt


@needs_fixture
def test_local_walrus_pt_picks_up_extended_config(
    tmp_path: Path, released: dict[str, bytes], fixture: dict, capsys
) -> None:
    (tmp_path / "walrus.pt").write_bytes(released["walrus.pt"])
    (tmp_path / "extended_config.yaml").write_bytes(released["extended_config.yaml"])
    assert convert_main(["convert", str(tmp_path / "walrus.pt"), str(tmp_path / "w.ckpt")]) == 0
    assert "extended_config.yaml (found beside" in capsys.readouterr().out
    model, vocab = load_model(tmp_path / "w.ckpt")
    assert vocab.names == FIELDS
    # the same in memory, as init_from= and walrus.load read it
    ckpt, file = hub.open_checkpoint(tmp_path / "walrus.pt")
    assert file == tmp_path / "walrus.pt" and ckpt["walrus"]["vocab"] == vocab.to_dict()
    loaded = walrus.load(tmp_path / "walrus.pt")
    x = fixture["x"].transpose(0, 1)
    with torch.no_grad():
        y = loaded.model(x, fixture["state_labels"], fixture["bcs"][0]).transpose(0, 1)
    assert rel(y, fixture["y"]) < 1e-5
    # without the config: the converter's defaults (placeholder names for this small model)
    (tmp_path / "extended_config.yaml").unlink()
    assert walrus.load(tmp_path / "walrus.pt").vocab.names[3] == "official_field_3"


# ------------------------------------------------------------------------ train.py, infer.py


def _write_velocity_data(root: Path) -> None:
    """A dataset of the fixture's fields (pressure and velocity), 32 x 32, 8 frames."""
    rng = np.random.default_rng(0)
    for split in ("train", "valid", "test"):
        write_well_file(
            root / "flow" / "data" / split / "flow.hdf5",
            "flow",
            coords={"x": np.arange(32, dtype=np.float32), "y": np.arange(32, dtype=np.float32)},
            time=np.arange(8, dtype=np.float32),
            n_trajectories=2,
            fields={"pressure": rng.normal(size=(2, 8, 32, 32)).astype(np.float32) + 1},
            vector_fields={"velocity": rng.normal(size=(2, 8, 32, 32, 2)).astype(np.float32)},
        )


@needs_fixture
def test_infer_rollout_and_finetune_from_hub_offline(
    offline_cache: Path, released: dict[str, bytes], compose_cfg, tmp_path: Path
) -> None:
    from walrus.inference import run
    from walrus.training.train import train

    add_to_cache(offline_cache, REPO_ID, released)
    _write_velocity_data(tmp_path / "data")
    url = f"hf://{REPO_ID}"
    result = run(
        compose_cfg(
            "infer",
            [
                "command=rollout",
                f"ckpt_path={url}",
                f"paths.data_dir={tmp_path / 'data'}",
                "data.datasets=[flow]",
                "data.n_steps_input=2",
                "steps=2",
                "trajectories=0",
                f"out={tmp_path / 'rollout'}",
                "trainer.accelerator=cpu",
                "progress=false",
                "plots=false",
            ],
        )
    )
    metrics = result["metrics"]
    assert metrics["checkpoint"].startswith(str(offline_cache / "models--polymathic-ai--walrus"))
    assert metrics["datasets"]["flow"]["metrics"]["steps"] == 2

    overrides = tiny_train_overrides(tmp_path / "data", tmp_path / "ft", "finetune")
    overrides += [
        f"init_from={url}",
        "data.datasets=[flow]",
        "data.n_steps_input=2",
        "data.batch_size=1",
        "data.max_val_windows=1",
        "optimizer.lr=0.0",
    ]
    train(compose_cfg("train", overrides))
    model, vocab = load_model(tmp_path / "ft" / "checkpoints" / "last.ckpt")
    assert vocab.names == FIELDS and model.compat == "walrus_current"
