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
ONE_THREAD = "libgomp-1thread"  # the setting whose TPOT, per thread, is the limit
IDLE_WINDOW_S = 5.0  # how long after its last request an idle server's CPU is read


# ---------------------------------------------------------------- what is measured


# The OpenMP runtimes a setting runs: torch's GNU libgomp (plain vLLM preloads it), Intel's
# libiomp5 (the launcher's), LLVM's libomp (Intel's code base; --libomp-path names it).
GOMP, IOMP, LLVM_OMP = "libgomp", "libiomp5", "libomp"
# libgomp's spin count for ~200 ms before sleeping (GCC libgomp/env.c: "100000 spins per
# msec"; its default 300000 is ~3 ms, OMP_WAIT_POLICY=active 30 billion, ~5 min): the
# KMP_BLOCKTIME of the launcher's nobind rule, in libgomp's unit.
SPIN_200_MS = "20000000"
# libiomp5's distributed barrier (KMP_*_BARRIER_PATTERN), in place of its default hyper one.
DIST_BARRIERS = tuple(
    (f"KMP_{kind}_BARRIER_PATTERN", "dist,dist") for kind in ("FORKJOIN", "PLAIN", "REDUCTION")
)


@dataclass(frozen=True)
class Setting:
    """A runtime configuration: the OpenMP runtime and what else is preloaded, how the
    worker binds, and the variables the runtime reads (set for every vLLM process)."""

    key: str
    runtime: str  # GOMP, IOMP or LLVM_OMP
    tcmalloc: bool = False
    blocktime: str | None = None  # the launcher's --kmp-blocktime
    nobind: bool = False  # VLLM_CPU_OMP_THREADS_BIND=nobind
    variables: tuple[tuple[str, str], ...] = ()

    @property
    def plain(self) -> bool:
        """Plain `vllm serve`, no launcher: vLLM preloads libgomp itself."""
        return self.runtime == GOMP and not self.tcmalloc

    @property
    def baseline(self) -> str:
        """The plain setting this one is compared with: as bound as it is."""
        return "libgomp-nobind" if self.nobind else "libgomp"

    def launcher_options(self, tcmalloc_path: Path, libomp_path: Path | None) -> list[str]:
        tcmalloc = ["--tcmalloc", "always", "--tcmalloc-path", str(tcmalloc_path)]
        options = ["--iomp", "never" if self.runtime == GOMP else "always"]
        if self.runtime == LLVM_OMP:
            options += ["--iomp-path", str(libomp_path)]
        options += tcmalloc if self.tcmalloc else ["--tcmalloc", "never"]
        return options + (["--kmp-blocktime", self.blocktime] if self.blocktime else [])


SETTINGS = {
    s.key: s
    for s in (
        Setting("libgomp", GOMP),
        Setting("libgomp+tcmalloc", GOMP, tcmalloc=True),
        Setting("libiomp5", IOMP),
        Setting("libiomp5+tcmalloc", IOMP, tcmalloc=True),
        Setting("libgomp-nobind", GOMP, nobind=True),
        Setting("libiomp5-nobind-bt0", IOMP, blocktime="0", nobind=True),
        Setting("libiomp5-nobind-bt200", IOMP, blocktime="200", nobind=True),
        # Issue 46: the block times between, and the team sized to a quota of 1 CPU.
        Setting("libiomp5-nobind-bt1", IOMP, blocktime="1", nobind=True),
        Setting("libiomp5-nobind-bt5", IOMP, blocktime="5", nobind=True),
        Setting(
            "libiomp5-nobind-bt200-t1",
            IOMP,
            blocktime="200",
            nobind=True,
            variables=(("OMP_NUM_THREADS", "1"),),
        ),
        # The shared host (issue 46): vLLM's binding sets the worker's block time (5), so the
        # launcher's reaches only the API server and engine core: none at all, and one thread.
        Setting("libiomp5-bt0", IOMP, blocktime="0"),
        # Plain vLLM once more, paired with plain: how far plain moves against itself.
        Setting("libgomp-again", GOMP),
        Setting("libiomp5-bt0-t1", IOMP, blocktime="0", variables=(("OMP_NUM_THREADS", "1"),)),
        Setting(
            "libiomp5-nobind-bt200+tcmalloc", IOMP, tcmalloc=True, blocktime="200", nobind=True
        ),
        # Issue 24: the runtimes and their waiting policies.
        Setting("libgomp-active", GOMP, variables=(("OMP_WAIT_POLICY", "active"),)),
        Setting("libgomp-spin200ms", GOMP, variables=(("GOMP_SPINCOUNT", SPIN_200_MS),)),
        Setting(
            "libgomp-nobind-active", GOMP, nobind=True, variables=(("OMP_WAIT_POLICY", "active"),)
        ),
        Setting(
            "libgomp-nobind-spin200ms",
            GOMP,
            nobind=True,
            variables=(("GOMP_SPINCOUNT", SPIN_200_MS),),
        ),
        Setting("libomp", LLVM_OMP),
        Setting("libomp-nobind-bt200", LLVM_OMP, blocktime="200", nobind=True),
        Setting(
            "libomp-nobind-bt200+tcmalloc", LLVM_OMP, tcmalloc=True, blocktime="200", nobind=True
        ),
        Setting("libiomp5-dist", IOMP, variables=DIST_BARRIERS),
        Setting(
            "libiomp5-nobind-bt200-dist",
            IOMP,
            blocktime="200",
            nobind=True,
            variables=DIST_BARRIERS,
        ),
        # The limit's reference: one OpenMP thread, unbound (bench_vllm_report.limit_rows).
        Setting(ONE_THREAD, GOMP, nobind=True, variables=(("OMP_NUM_THREADS", "1"),)),
    )
}
# vLLM's CPU Docker image preloads tcmalloc and libiomp5 (LD_PRELOAD in its Dockerfile) and
# leaves the binding to vLLM: the recipe users already have, so a peer to beat, not plain.
DOCKER_RECIPE = "libiomp5+tcmalloc"

DRAFT_SIZE = "tiny"  # the draft model's size: too small for anything to draft for it
EAGLE_HEAD = "eagle-head"  # Method.draft of EAGLE: the head made for the target
# Real weights (issue 30): SmolLM2-135M-Instruct as scripts/real_model.py makes it
# (--real-model), drafted for by itself or by a shallow draft cut from its first layers
# (--real-draft); the made models above have random weights, whose drafts are never accepted.
REAL = "smollm2"
SYNTHETIC = ("tiny", "100m")  # the sizes scripts/make_tiny_model.py makes
MODELS = (*SYNTHETIC, REAL)
SELF_DRAFT = "self"  # Method.draft: the target drafts for itself (near-total acceptance)
SHALLOW_DRAFT = "shallow"  # Method.draft: --real-draft, the target's first layers
REAL_DRAFTS = (SELF_DRAFT, SHALLOW_DRAFT)
# What the real model's clients ask (vllm_server.PROMPT, a repetition, is the made models'):
# prose with a task that quotes it, as editing or answering from a document does, so that
# ngram finds what the model's own text repeats (a story alone: 0 of 15 drafted tokens
# accepted in a first start) and a draft model is accepted as the model's text allows.
REAL_PROMPT = (
    "Text: The lighthouse keeper climbed the stairs at dusk, as he had every evening for "
    "thirty years. That night, though, something on the rocks below caught his eye.\n"
    "Repeat the text above, then say what the keeper saw.\n"
    "Answer: The lighthouse keeper"
)
# vLLM's options for the real model (its config allows 8192 tokens; the map needs few).
REAL_SERVE_OPTIONS = ("--max-model-len", "2048")


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
    draft: str | None = None  # what drafts: DRAFT_SIZE's model, EAGLE_HEAD, or REAL_DRAFTS
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
        if self.draft is None or self.draft in REAL_DRAFTS:
            return None
        return Made(model, eagle_head=True) if self.draft == EAGLE_HEAD else Made(self.draft)

    def draft_key(self, model: str) -> str | None:
        """The key of the draft's directory among the map's paths (bench_vllm.prepare): a
        made model's, the target's own (self-draft), or the shallow draft's."""
        made = self.draft_for(model)
        if made is not None:
            return made.key
        return model if self.draft == SELF_DRAFT else self.draft

    def runs_on(self, model: str) -> bool:
        """Whether the method runs on the target `model`: ngram always; the real drafts on
        the real model alone; a made draft (the tiny model, or an EAGLE head) only for the
        larger made model (nothing made here drafts the tiny one at much less than its own
        cost, and the real model's tokenizer is not theirs)."""
        if self.draft is None:
            return True
        if self.draft in REAL_DRAFTS:
            return model == REAL
        return model in SYNTHETIC and model != DRAFT_SIZE


METHODS = {
    m.key: m
    for m in (
        Method(FIRST_METHOD, "ngram", 3, prompt_lookup_max=3),
        Method("draft3", "draft_model", 3, draft=DRAFT_SIZE),
        Method("draft7", "draft_model", 7, draft=DRAFT_SIZE),
        # Not `eagle3`: that is vLLM's name for EAGLE-3, another method.
        Method("eagle-3", "eagle", 3, draft=EAGLE_HEAD),
        # Real weights only (issue 30): no EAGLE head is trained for SmolLM2.
        Method("self3", "draft_model", 3, draft=SELF_DRAFT),
        Method("self7", "draft_model", 7, draft=SELF_DRAFT),
        Method("shallow3", "draft_model", 3, draft=SHALLOW_DRAFT),
        Method("shallow7", "draft_model", 7, draft=SHALLOW_DRAFT),
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


# Named maps (--map): each method with the settings its rules' pairs need, served at vLLM's
# default reservation, the rules' condition. `real` (issue 30): plain vLLM (libgomp) against
# the settings of each rule a real model can run, to re-judge it: map-1/map-2 and
# runtimes-1 for ngram (nobind, KMP_BLOCKTIME=200, Intel's or LLVM's runtime; map-2's and
# runtimes-1's baseline libgomp under nobind), methods-4 and runtimes-3 for draft_model
# with 7 tokens (tcmalloc beside them) at near-total acceptance (the model drafting for
# itself) and partial (its shallow draft; LLVM's runtime with the self-draft alone). Sized
# for one working session on 2 idle CPUs (9 starts a round, about 19 minutes): 3-token
# drafts, where no rule adds anything, are left to `--methods`/`--settings`.
MAPS = {
    "real": {
        FIRST_METHOD: (
            "libgomp",
            "libgomp-nobind",
            "libiomp5-nobind-bt200",
            "libomp-nobind-bt200",
        ),
        "self7": ("libgomp", "libiomp5-nobind-bt200+tcmalloc", "libomp-nobind-bt200+tcmalloc"),
        "shallow7": ("libgomp", "libiomp5-nobind-bt200+tcmalloc"),
    }
}


def mapped(table: dict[str, tuple[str, ...]]) -> list[Config]:
    """The configurations of a named map, on the real model: a nobind setting's threads are
    NOBIND, a bound one's vLLM's default reservation."""
    return [
        Config(REAL, method, NOBIND if SETTINGS[key].nobind else "default", key)
        for method, keys in table.items()
        for key in keys
    ]


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
    # vLLM's SD counters over this phase (as Run.sd_counts); none: kept before issue 37.
    sd_counts: dict[str, float] = field(default_factory=dict)

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
    # Cores busy by process role over IDLE_WINDOW_S after the last request (none: a run
    # kept before the map read it).
    idle: dict[str, float] = field(default_factory=dict)
    # vLLM's SD counters over the phases (bench_vllm_run.SD_COUNTERS: drafts, draft_tokens,
    # accepted_tokens); none: a run kept before the map read them.
    sd_counts: dict[str, float] = field(default_factory=dict)

    def phase(self, streams: int) -> Phase:
        return next(p for p in self.phases if p.streams == streams)

    @property
    def accepted_per_step(self) -> float:
        """Draft tokens accepted per verifying step of the target (0 to the method's
        tokens): what one target forward pass gains beyond its own token."""
        drafts = self.sd_counts.get("drafts", 0.0)
        return self.sd_counts.get("accepted_tokens", 0.0) / drafts if drafts else float("nan")


def runs_from_json(data: dict[str, Any]) -> list[Run]:
    """The runs of a `--json` file, as measured (a run kept without a method: FIRST_METHOD)."""
    runs = []
    for item in data["runs"]:
        phases = [Phase(**phase) for phase in item.pop("phases")]
        config = Config(**{"method": FIRST_METHOD, **item.pop("config")})
        runs.append(Run(config=config, phases=phases, **item))
    return runs
