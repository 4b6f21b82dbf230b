"""What the vLLM map measures and keeps: configurations, and the record of each start.

scripts/bench_vllm.py's jobs (running vLLM, the report, the plot) share these types: a
configuration (model, speculative-decoding method, OpenMP threads, runtime setting), which
plain vLLM it is compared with, and what one start measured, as `--json` keeps it and
`--from-json` reads it back.
Standard library only; the bench_vllm modules import it as a sibling module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# What runs kept before methods were a dimension of the map (issue 18) all ran with.
FIRST_METHOD = "ngram3"
TPOT_METRIC = "vllm:request_time_per_output_token_seconds"  # histogram: _sum, _count
WARMUP_REQUESTS = 2  # per start, before any phase is measured
ROLES = ("worker", "engine", "api")  # the processes whose CPU a phase keeps


# ---------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class Setting:
    """A runtime configuration: which libraries are preloaded, and how the worker binds."""

    key: str
    iomp: bool
    tcmalloc: bool
    blocktime: str | None = None  # the launcher's --kmp-blocktime
    nobind: bool = False  # VLLM_CPU_OMP_THREADS_BIND=nobind

    @property
    def plain(self) -> bool:
        """Plain `vllm serve`, no launcher: vLLM preloads libgomp itself."""
        return not (self.iomp or self.tcmalloc)

    @property
    def baseline(self) -> str:
        """The plain setting this one is compared with: as bound as it is."""
        return "libgomp-nobind" if self.nobind else "libgomp"

    def launcher_options(self, tcmalloc_path: Path) -> list[str]:
        tcmalloc = ["--tcmalloc", "always", "--tcmalloc-path", str(tcmalloc_path)]
        options = ["--iomp", "always" if self.iomp else "never"]
        options += tcmalloc if self.tcmalloc else ["--tcmalloc", "never"]
        return options + (["--kmp-blocktime", self.blocktime] if self.blocktime else [])


SETTINGS = {
    s.key: s
    for s in (
        Setting("libgomp", iomp=False, tcmalloc=False),
        Setting("libgomp+tcmalloc", iomp=False, tcmalloc=True),
        Setting("libiomp5", iomp=True, tcmalloc=False),
        Setting("libiomp5+tcmalloc", iomp=True, tcmalloc=True),
        Setting("libgomp-nobind", iomp=False, tcmalloc=False, nobind=True),
        Setting("libiomp5-nobind-bt0", iomp=True, tcmalloc=False, blocktime="0", nobind=True),
        Setting("libiomp5-nobind-bt200", iomp=True, tcmalloc=False, blocktime="200", nobind=True),
        Setting(
            "libiomp5-nobind-bt200+tcmalloc", iomp=True, tcmalloc=True, blocktime="200", nobind=True
        ),
    )
}
# vLLM's CPU Docker image preloads tcmalloc and libiomp5 (LD_PRELOAD in its Dockerfile) and
# leaves the binding to vLLM: the recipe users already have, so a peer to beat, not plain.
DOCKER_RECIPE = "libiomp5+tcmalloc"

DRAFT_SIZE = "tiny"  # the draft model's size: too small for anything to draft for it
EAGLE_HEAD = "eagle-head"  # Method.draft of EAGLE: the head made for the target


@dataclass(frozen=True)
class Made:
    """A model scripts/make_tiny_model.py makes: a size, or the EAGLE head for that size."""

    size: str
    eagle_head: bool = False

    @property
    def key(self) -> str:
        return f"{self.size}-{EAGLE_HEAD}" if self.eagle_head else self.size

    def options(self) -> list[str]:
        """make_tiny_model.py's options for it."""
        return ["--size", self.size, *(["--eagle-head"] if self.eagle_head else [])]


@dataclass(frozen=True)
class Method:
    """A speculative-decoding method, as vLLM's --speculative-config names it: the runtime's
    cost differs with what runs between the target's steps (a proposer in Python, or a draft
    model's own forward passes, each a series of short OpenMP regions)."""

    key: str
    method: str  # vLLM's `method`
    tokens: int  # `num_speculative_tokens`
    draft: str | None = None  # what drafts: DRAFT_SIZE's model, or EAGLE_HEAD
    prompt_lookup_max: int | None = None  # ngram: the longest n-gram looked up

    def speculative_config(self, draft: str) -> str:
        """The --speculative-config JSON, with `draft` (a path) as the draft model's."""
        config: dict[str, object] = {"method": self.method}
        if self.draft is not None:
            config["model"] = draft
        config["num_speculative_tokens"] = self.tokens
        if self.prompt_lookup_max is not None:
            config["prompt_lookup_max"] = self.prompt_lookup_max
        return json.dumps(config, separators=(",", ":"))

    def draft_for(self, model: str) -> Made | None:
        """The made model that drafts for the target `model`, if one does."""
        if self.draft is None:
            return None
        return Made(model, eagle_head=True) if self.draft == EAGLE_HEAD else Made(self.draft)

    def runs_on(self, model: str) -> bool:
        """Whether the method runs on the target `model`: ngram always, a draft (the tiny
        model, or an EAGLE head) only for a target larger than the tiny model, for which
        nothing made here drafts at much less than the target's own cost."""
        return self.draft is None or model != DRAFT_SIZE


METHODS = {
    m.key: m
    for m in (
        Method(FIRST_METHOD, "ngram", 3, prompt_lookup_max=3),
        Method("draft3", "draft_model", 3, draft=DRAFT_SIZE),
        Method("draft7", "draft_model", 7, draft=DRAFT_SIZE),
        # Not `eagle3`: that is vLLM's name for EAGLE-3, another method.
        Method("eagle-3", "eagle", 3, draft=EAGLE_HEAD),
    )
}
THREADS = {"default": "vLLM's default reservation", "all": "all CPUs (reserved 0, or nobind)"}
NOBIND = "nobind"  # the threads column of nobind settings: the team spans every CPU


@dataclass(frozen=True)
class Config:
    model: str
    method: str  # a key of METHODS
    threads: str  # "default", "all", or NOBIND
    setting: str

    @property
    def name(self) -> str:
        return f"{self.model}/{self.method}/{self.threads}/{self.setting}"


def grid(
    models: Sequence[str], methods: Sequence[str], threads: Sequence[str], settings: Sequence[str]
) -> list[Config]:
    """Every method that drafts for the model, every bound setting at every thread count; a
    nobind one once (reservation is moot)."""
    configs = []
    for model in models:
        for method in (key for key in methods if METHODS[key].runs_on(model)):
            for key in settings:
                counts = [NOBIND] if SETTINGS[key].nobind else threads
                configs += [Config(model, method, count, key) for count in counts]
    return configs


def baseline_of(config: Config) -> Config:
    """Plain vLLM with the same method, OpenMP threads and binding: what config is compared
    with."""
    return replace(config, setting=SETTINGS[config.setting].baseline)


# ---------------------------------------------------------------- what a start keeps


@dataclass
class Phase:
    streams: int
    tokens: int = 0
    requests: int = 0
    wall_s: float = 0.0
    tpot_ms: float = float("nan")  # vLLM's own per-request TPOT, mean over the phase
    cores: dict[str, float] = field(default_factory=dict)  # CPU-s per wall-s, by process role

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


@dataclass
class Run:
    config: Config
    round: int
    startup_s: float
    phases: list[Phase]
    acceptance: float
    worker: str
    core_ids: str
    sd_warning: bool
    launcher_info: str
    load_before: float

    def phase(self, streams: int) -> Phase:
        return next(p for p in self.phases if p.streams == streams)


def runs_from_json(data: dict[str, Any]) -> list[Run]:
    """The runs of a `--json` file, as measured (a run kept without a method: FIRST_METHOD)."""
    runs = []
    for item in data["runs"]:
        phases = [Phase(**phase) for phase in item.pop("phases")]
        config = Config(**{"method": FIRST_METHOD, **item.pop("config")})
        runs.append(Run(config=config, phases=phases, **item))
    return runs
