"""Reading a results directory (docs/results-format.md) into tables: the manifest, samples,
trials and steps, each checked as it is read; a file that is missing or malformed is a
MoebenchError naming it. Trials and steps are optional (None when absent).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from moebench.errors import MoebenchError
from moebench.fileio import read_json, read_jsonl

MANIFEST_SCHEMA = "moebench.manifest/1"


@dataclass
class RunData:
    run_dir: Path
    manifest: dict
    samples: pd.DataFrame
    trials: pd.DataFrame | None
    steps: pd.DataFrame | None
    # a run with offered loads (docs/serving-load.md): every load's records; samples, trials and steps
    # above are the primary load's, on which accuracy and speedups are judged as in a closed-loop run
    by_load: "LoadData | None" = None

    @property
    def config_names(self) -> list[str]:
        return [c["name"] for c in self.manifest["configs"]]


@dataclass
class LoadData:
    labels: list[str]  # in the order each trial ran them
    primary: str
    samples: pd.DataFrame
    trials: pd.DataFrame | None
    steps: pd.DataFrame | None


# ---------------------------------------------------------------- loading

def _load_manifest(path: Path) -> dict:
    manifest = read_json(path, "missing (not a moebench results directory?)")
    if not isinstance(manifest, dict):
        raise MoebenchError(f"{path}: expected a JSON object")
    schema = manifest.get("schema", MANIFEST_SCHEMA)
    if schema != MANIFEST_SCHEMA:
        raise MoebenchError(f"{path}: schema {schema!r}, expected {MANIFEST_SCHEMA!r}")
    configs = manifest.get("configs")
    if not isinstance(configs, list) or not configs or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in configs):
        raise MoebenchError(f"{path}: 'configs' must be a non-empty list of objects with a 'name'")
    names = [c["name"] for c in configs]
    if len(set(names)) != len(names):
        raise MoebenchError(f"{path}: duplicate config names in 'configs'")
    baseline = manifest.get("baseline", names[0])
    if baseline not in names:
        raise MoebenchError(f"{path}: baseline {baseline!r} is not one of the configs {names}")
    manifest["baseline"] = baseline
    return manifest


def _load_jsonl_table(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    records = read_jsonl(path)
    for lineno, rec in enumerate(records, 1):
        if not isinstance(rec, dict) or any(k not in rec for k in required):
            missing = [k for k in required if not isinstance(rec, dict) or k not in rec]
            raise MoebenchError(f"{path}: record {lineno} lacks {', '.join(missing)}")
    df = pd.DataFrame.from_records(records)
    if df.empty:
        return pd.DataFrame(columns=list(required))
    df["trial"] = pd.to_numeric(df["trial"], errors="coerce")
    if df["trial"].isna().any():
        raise MoebenchError(f"{path}: 'trial' must be an integer in every record")
    df["trial"] = df["trial"].astype(int)
    df["config"] = df["config"].astype(str)
    return df


def _load_samples(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise MoebenchError(f"{path}: missing (no samples: nothing to summarize)")
    df = _load_jsonl_table(path, ("config", "trial", "item_id"))
    if df.empty:
        raise MoebenchError(f"{path}: no samples")
    df["item_id"] = df["item_id"].astype(str)
    for col, default in (("output", ""), ("answer", None), ("correct", False),
                         ("finish_reason", None), ("error", None), ("itl_s", None)):
        if col not in df:
            df[col] = default
    df["output"] = df["output"].fillna("").astype(str)
    df["correct"] = df["correct"].map(lambda v: v is True or v == 1)
    # A resumed run may re-append an item; the last complete line wins.
    keys = ["config", "trial", "item_id"] + (["load"] if "load" in df else [])
    return df.drop_duplicates(subset=keys, keep="last").reset_index(drop=True)


def _load_trials(path: Path) -> pd.DataFrame | None:
    if not path.is_file():
        return None
    df = _load_jsonl_table(path, ("config", "trial"))
    if df.empty:
        return None
    keys = ["config", "trial"] + (["load"] if "load" in df else [])
    return df.drop_duplicates(subset=keys, keep="last").sort_values(
        ["config", "trial"]).reset_index(drop=True)


def _load_steps(path: Path) -> pd.DataFrame | None:
    if not path.is_file():
        return None
    try:
        df = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise MoebenchError(f"{path}: unreadable parquet ({type(e).__name__}: {e})") from None
    for col in ("config", "trial"):
        if col not in df:
            raise MoebenchError(f"{path}: missing column {col!r}")
    if df.empty:
        return None
    df["config"] = df["config"].astype(str)
    return df


def load_run(run_dir: Path) -> RunData:
    """Read a results directory; MoebenchError naming the file if something is unusable."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MoebenchError(f"{run_dir}: not a directory")
    manifest = _load_manifest(run_dir / "manifest.json")
    samples = _load_samples(run_dir / "samples.jsonl")
    trials = _load_trials(run_dir / "trials.jsonl")
    steps = _load_steps(run_dir / "steps.parquet")
    if not manifest.get("loads"):
        return RunData(run_dir, manifest, samples, trials, steps)
    by_load = LoadData([ld["label"] for ld in manifest["loads"]], manifest.get("primary_load"), samples, trials, steps)
    if by_load.primary not in by_load.labels:
        raise MoebenchError(f"{run_dir / 'manifest.json'}: primary_load {by_load.primary!r} is not one of its loads")

    def primary(df):
        if df is None or "load" not in df:
            return df
        return df[df["load"] == by_load.primary].reset_index(drop=True)
    mine = primary(samples)
    if mine.empty:
        raise MoebenchError(f"{run_dir / 'samples.jsonl'}: no samples at the primary load {by_load.primary!r} yet")
    return RunData(run_dir, manifest, mine, primary(trials), primary(steps), by_load)


def is_error(df: pd.DataFrame) -> pd.Series:
    """Which samples are failed requests (HTTP engines): an error text, or the finish reason "error"."""
    err = df["error"].notna()
    if "finish_reason" in df:
        err |= df["finish_reason"] == "error"
    return err


def per_item(samples: pd.DataFrame, name: str) -> pd.DataFrame:
    """One sample per item for a config: trial 0's (the lowest trial that has the item).

    Greedy decoding makes every trial give the same answer, so trial 0 stands for all.
    """
    df = samples[samples["config"] == name].sort_values("trial", kind="stable")
    return df.drop_duplicates(subset=["item_id"], keep="first").set_index("item_id")

