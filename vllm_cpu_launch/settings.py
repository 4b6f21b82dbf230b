"""Launcher settings from options, VLLMCPULAUNCH_* variables and YAML config files (their
precedence: docs/design.md), each validated where it is read so that an error names where
it came from; and the `tune --write` records that apply to this launch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.handoff import FALSE_WORDS, PLUGIN_VARIABLE, TRUE_WORDS
from vllm_cpu_launch.messages import StrEnum, shown
from vllm_cpu_launch.records import record, replace
from vllm_cpu_launch.shape import HostCpus
from vllm_cpu_launch.trust import FileProblem, read_trusted

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import TypeGuard, TypeVar

    T = TypeVar("T")
    from vllm_cpu_launch.command import SpeculativeRequest


class Mode(StrEnum):
    """What --iomp and --tcmalloc say: preload where the plan wants it, always, or never."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class Given(StrEnum):
    """Where --iomp's value came from: a matching tune record wins over CONFIG."""

    OPTION = "option"
    VARIABLE = "variable"
    CONFIG = "config"
    DEFAULT = "default"


SYSTEM_CONFIG = "/etc/vllm-cpu-launch/config.yaml"
CONFIG_VARIABLE = "VLLMCPULAUNCH_CONFIG"
# Our variables were named VLLM_CPU_LAUNCH_* in 0.1: vLLM reports every VLLM_* variable
# it does not know (Platform.validate_environ) and refuses to start on one with
# --fail-on-environ-validation. The old names are still read, each said once as deprecated.
VARIABLE_PREFIX = "VLLMCPULAUNCH_"
DEPRECATED_PREFIX = "VLLM_CPU_LAUNCH_"
LARGE_BLOCKTIME_MS = 200
TUNED_FIELDS = ("when", "iomp", "result", "rounds", "command")  # of a `tuned:` record
TUNED_OPTIONAL = ("scope", "concurrency")
LABELS = dict(model="model", method="SD method", tokens="draft tokens", vllm="vLLM", cpus="CPUs")


@record
class Scope:
    """What a tune measured, so that it applies only there. None: not recorded (any)."""

    model: str | None = None
    method: str | None = None
    tokens: int | None = None
    vllm: str | None = None
    cpus: int | None = None


@record
class Tuned:
    """What `tune --write` measured: it chose `iomp` at `when`; `result` says by what margin."""

    when: str  # ISO 8601 UTC time, e.g. 2026-12-01T10:02Z
    iomp: Mode  # the value it found best (auto: no clear winner, the default kept)
    result: str  # e.g. "libgomp 1.12x faster than libiomp5, spread 0.03"
    rounds: int
    command: str  # the command line it measured (`vllm serve ...`; `vllm bench latency ...` before)
    scope: Scope | None = None  # None: written before tunes were scoped (record_scope)
    origin: str = ""  # the config file it was read from
    # A serving tune's --iomp value at each concurrency (auto: no clear winner there).
    concurrency: tuple[tuple[int, Mode], ...] = ()


@record
class Settings:
    """What the user asked of the launcher, after precedence and validation."""

    iomp: Mode = Mode.AUTO
    iomp_path: str | None = None
    tcmalloc: Mode = Mode.AUTO
    tcmalloc_path: str | None = None
    kmp_blocktime: str | None = None
    host_cpus: HostCpus = HostCpus.AUTO
    vllm: str | None = None
    strict: bool = False
    plugin: bool = True  # vLLM's plugin applies the plan (docs/design.md, "The plugin")
    config_files: tuple[str, ...] = ()  # the files that were read, for doctor and -v
    iomp_from: Given = Given.DEFAULT
    tuned: tuple[Tuned, ...] = ()  # every tune record, the one with the highest precedence first
    deprecated: tuple[str, ...] = ()  # a warning for each VLLM_CPU_LAUNCH_* variable read
    sources: tuple[tuple[str, str], ...] = ()  # where each setting not its default came from


def said_setting(settings: Settings, key: str) -> str:
    """A setting as every message names it, with its source: `--iomp never`,
    `VLLMCPULAUNCH_IOMP=never` or `iomp: never in FILE` (a default as its option)."""
    value = getattr(settings, key)
    shown = str(value).lower() if isinstance(value, bool) else value
    option, variable, _ = KEYS[key]
    source = dict(settings.sources).get(key, option or variable)
    if source == option:
        return option if isinstance(value, bool) else f"{option} {shown}"
    return f"{variable}={shown}" if source == variable else f"{key}: {shown} in {source}"


def fail(where: str, problem: str) -> LaunchError:
    return LaunchError(EXIT_USAGE, f"{where}: {problem}")


def positive(value: object) -> TypeGuard[int]:
    """A whole number of at least 1; YAML's true and false are no numbers."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_mode(value: object, where: str) -> Mode:
    """auto, always or never, in any case (as yes/no values are)."""
    if isinstance(value, str) and value.lower() in tuple(Mode):
        return Mode(value.lower())
    hint = " (YAML reads off/no/on/yes as true or false: write never or always)"
    said = hint if isinstance(value, bool) else ""
    raise fail(where, f"{shown(value)} is not one of {', '.join(Mode)}{said}")


def parse_host_cpus(value: object, where: str) -> HostCpus:
    if isinstance(value, str) and value.lower() in tuple(HostCpus):
        return HostCpus(value.lower())
    raise fail(where, f"{shown(value)} is not one of {', '.join(HostCpus)}")


def parse_library_path(value: object, where: str) -> str:
    if isinstance(value, str) and os.path.isabs(value):
        return value
    if not isinstance(value, str) or not value:
        raise fail(where, "needs the absolute path of a library file")
    why = "since what is preloaded must not depend on the working directory"
    raise fail(where, f"{shown(value)} is relative; give an absolute path, {why}")


def blocktime_milliseconds(text: str) -> float | None:
    """KMP_BLOCKTIME in milliseconds (`5`, `5ms`, `500us`, `infinite`); None if invalid."""
    if text == "infinite":
        return float("inf")
    scale = {"ms": 1.0, "us": 0.001}.get(text[-2:])
    number = text if scale is None else text[:-2]
    return int(number) * (scale or 1.0) if number.isascii() and number.isdigit() else None


def blocktime_problem(value: str) -> str | None:
    """What is slow or wasteful about a KMP_BLOCKTIME value, or None."""
    milliseconds = blocktime_milliseconds(value)
    if milliseconds is None:
        return (
            f"KMP_BLOCKTIME={shown(value)} is not a number of milliseconds; the runtime ignores it"
        )
    if milliseconds == 0:
        return (
            f"KMP_BLOCKTIME={value}: threads sleep at once after each parallel region, losing what "
            "Intel OpenMP gains for speculative decoding; the launcher's default is 5"
        )
    if milliseconds > LARGE_BLOCKTIME_MS:
        return (
            f"KMP_BLOCKTIME={value}: idle threads spin that long and burn CPU the API server "
            "and other processes need; vLLM's own workers use 5"
        )
    return None


def parse_blocktime(value: object, where: str) -> str:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(text, str) and blocktime_milliseconds(text) is not None:
        return text
    raise fail(
        where, f"{shown(value)} is not a KMP_BLOCKTIME: use milliseconds like 5, or infinite"
    )


def parse_text(value: object, where: str) -> str:
    if isinstance(value, str) and value:
        return value
    raise fail(where, f"needs a non-empty text (a path or a name), not {shown(value)}")


def parse_bool(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    raise fail(where, f"{shown(value)} is not a yes/no value (use 1 or 0, true or false)")


def keyed(
    value: object, where: str, fields: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, object]:
    """A record's mapping of `fields` (and `optional` ones) only."""
    if not isinstance(value, dict):
        raise fail(where, f"must be a mapping of {', '.join(fields)}, not {shown(value)}")
    for key in value:
        if key not in (*fields, *optional):
            allowed = ", ".join((*fields, *optional))
            raise fail(where, f"unknown key {shown(key)}; allowed keys: {allowed}")
    return value


def parse_tuned(value: object, where: str) -> tuple[Tuned, ...]:
    """`tuned:`: a list of records (one a mapping, as tunes before scoping wrote it)."""
    if isinstance(value, list):
        return tuple(parse_tune_record(item, f"{where}[{i}]") for i, item in enumerate(value))
    return (parse_tune_record(value, where),)


def parse_tune_record(value: object, where: str) -> Tuned:
    """One record: a mapping of exactly TUNED_FIELDS (and optional ones), each of its type."""
    fields = keyed(value, where, TUNED_FIELDS, TUNED_OPTIONAL)
    missing = [key for key in TUNED_FIELDS if key not in fields]
    if missing:
        raise fail(where, f"lacks {', '.join(missing)}")
    when = fields["when"]  # YAML reads an unquoted time as a timestamp
    rounds = fields["rounds"]
    if not positive(rounds):
        raise fail(f"{where}.rounds", f"{shown(rounds)} is not a positive number of rounds")
    return Tuned(
        when=parse_text(when.isoformat() if hasattr(when, "isoformat") else when, f"{where}.when"),
        iomp=parse_mode(fields["iomp"], f"{where}.iomp"),
        result=parse_text(fields["result"], f"{where}.result"),
        rounds=rounds,
        command=parse_text(fields["command"], f"{where}.command"),
        scope=parse_scope(fields["scope"], f"{where}.scope") if "scope" in fields else None,
        concurrency=parse_concurrency(fields.get("concurrency", {}), f"{where}.concurrency"),
    )


def parse_concurrency(value: object, where: str) -> tuple[tuple[int, Mode], ...]:
    """A serving tune's `concurrency:` mapping: positive whole numbers to --iomp values."""
    if not isinstance(value, dict):
        raise fail(where, f"must map each concurrency to auto, always or never, not {shown(value)}")
    found = []
    for key, item in value.items():
        if not positive(key):
            raise fail(where, f"{shown(key)} is not a concurrency (a positive whole number)")
        found.append((key, parse_mode(item, f"{where}.{key}")))
    return tuple(sorted(found))


def parse_scope(value: object, where: str) -> Scope:
    """Texts (model, method, vllm) and counts (tokens, cpus), or null."""
    fields = keyed(value, where, tuple(LABELS))
    for key, item in fields.items():
        counted = key in ("tokens", "cpus")
        if item is not None and not (positive(item) if counted else isinstance(item, str) and item):
            kind = "a positive whole number" if counted else "a non-empty text"
            raise fail(f"{where}.{key}", f"{shown(item)} is not {kind} (or null)")
    return Scope(**fields)  # type: ignore[arg-type]


# key -> (option, environment variable, parser); "" where the launcher takes no option.
KEYS: dict[str, tuple[str, str, Callable[[object, str], object]]] = {
    "iomp": ("--iomp", "VLLMCPULAUNCH_IOMP", parse_mode),
    "iomp_path": ("--iomp-path", "VLLMCPULAUNCH_IOMP_PATH", parse_library_path),
    "tcmalloc": ("--tcmalloc", "VLLMCPULAUNCH_TCMALLOC", parse_mode),
    "tcmalloc_path": ("--tcmalloc-path", "VLLMCPULAUNCH_TCMALLOC_PATH", parse_library_path),
    "kmp_blocktime": ("--kmp-blocktime", "VLLMCPULAUNCH_KMP_BLOCKTIME", parse_blocktime),
    "host_cpus": ("--host-cpus", "VLLMCPULAUNCH_HOST_CPUS", parse_host_cpus),
    "vllm": ("--vllm", "VLLMCPULAUNCH_VLLM", parse_text),
    "strict": ("--strict", "VLLMCPULAUNCH_STRICT", parse_bool),
    "plugin": ("", PLUGIN_VARIABLE, parse_bool),  # read by vLLM's plugin only
}
CONFIG_ONLY_KEYS: dict[str, Callable[[object, str], object]] = {"tuned": parse_tuned}
FILE_KEYS = ("iomp_path", "tcmalloc_path", "vllm")


def config_file_path(value: object, where: str) -> object:
    """A file named in a config file, `~` expanded as a shell would (YAML does not); a
    relative path refused (a service's working directory is not the operator's), a bare
    name left to its key (`vllm: vllm` is looked up on PATH)."""
    path = os.path.expanduser(value) if isinstance(value, str) else value
    if isinstance(path, str) and os.sep in path and not os.path.isabs(path):
        why = "each start would look for it from its own working directory"
        raise fail(
            where, f"{shown(value)} is relative: {why}; give an absolute path (~ is expanded)"
        )
    return path


def user_config_path(environ: Mapping[str, str]) -> str | None:
    home = environ.get("HOME")
    base = environ.get("XDG_CONFIG_HOME") or (os.path.join(home, ".config") if home else None)
    return os.path.join(base, "vllm-cpu-launch", "config.yaml") if base else None


def read_config_file(path: str) -> dict[str, object]:
    """A config file's settings, validated; any problem is an error naming the file (one
    the trust rule refuses: read_trusted)."""
    try:
        text = read_trusted(path).decode("utf-8")
    except FileProblem as problem:
        raise fail(path, f"config file {problem.problem}") from None
    except UnicodeDecodeError as error:
        raise fail(path, f"config file is not UTF-8 text (byte {error.start})") from None
    import yaml  # lazy: only when a config file exists, the exec path stays light

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
            """An alias refused: a config file needs none, and nested ones (an alias bomb of
            600 bytes) expand past any memory."""
            if self.check_event(yaml.AliasEvent):
                alias = self.current_event  # what check_event looked at
                mark, fix = alias.start_mark, "write each value out: a config file takes none"
                problem = f"holds a YAML alias (of anchor {shown(alias.anchor)}); {fix}"
                raise fail(f"{path}:{mark.line + 1}:{mark.column + 1}", problem)
            return super().compose_node(parent, index)

    loader = Loader(text)
    try:
        document = loader.get_single_node()
        content = None if document is None else loader.construct_document(document)
    except yaml.YAMLError as error:
        # As `FILE:LINE:COLUMN: what`, where the unfinished construct began.
        mark = getattr(error, "context_mark", None) or getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        said = [getattr(error, name, None) for name in ("context", "problem")]
        what = ", ".join(text for text in said if text) or " ".join(str(error).split())
        fix = "write one `key: value` per line, e.g. `iomp: always`, and quote a value holding"
        raise fail(where, f"invalid YAML ({what}); {fix} : # [ ] {{ }} or a leading -") from None
    except RecursionError:
        deep = "nests its YAML deeper than the reader can take; a config file holds"
        raise fail(path, f"config file {deep} `key: value` lines") from None
    finally:
        loader.dispose()
    if document is None or content is None:
        return {}
    if not isinstance(content, dict):
        raise fail(path, f"must be a mapping of settings, not {type(content).__name__}")
    # kmp-blocktime is taken as written, not as YAML 1.1 types it: `00200` (octal 128 to
    # YAML), `0x10` or `1_000` mean what they mean as the option (200 ms, refused,
    # refused), not 128 and 16 and 1000. A dict was constructed from a MappingNode.
    written = {str(k.value): v.value for k, v in document.value if isinstance(v, yaml.ScalarNode)}
    values: dict[str, object] = {}
    for key, value in content.items():
        name = str(key).replace("-", "_")
        parse = KEYS[name][2] if name in KEYS else CONFIG_ONLY_KEYS.get(name)
        if parse is None:
            allowed = ", ".join(k.replace("_", "-") for k in (*KEYS, *CONFIG_ONLY_KEYS))
            raise fail(path, f"unknown key {shown(key)}; allowed keys: {allowed}")
        where = f"{path}: key {shown(key)}"
        if name == "kmp_blocktime":
            value = written.get(str(key), value)
        values[name] = parse(config_file_path(value, where) if name in FILE_KEYS else value, where)
    return values


def salvage(errors: list[str] | None, read: Callable[..., T], *args: object) -> T | None:
    """read(*args); when `errors` collects them, a failure is kept there and gives None."""
    try:
        return read(*args)
    except LaunchError as error:
        if errors is None:
            raise
        errors.append(error.message)
        return None


def deprecated_name(variable: str) -> str:
    """The name a variable of ours had before it left vLLM's VLLM_* namespace."""
    return DEPRECATED_PREFIX + variable.removeprefix(VARIABLE_PREFIX)


def ours_set(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without our empty variables: one is the same as unset (docs/design.md)."""
    ours = (VARIABLE_PREFIX, DEPRECATED_PREFIX)
    return {name: value for name, value in environ.items() if value or not name.startswith(ours)}


def with_current_names(environ: Mapping[str, str]) -> tuple[dict[str, str], tuple[str, ...]]:
    """`environ` with each VLLM_CPU_LAUNCH_* variable read under its current name (where
    that is unset), and a warning for each; empty ones are unset."""
    environ = ours_set(environ)
    current = dict(environ)
    warnings = []
    for variable in (CONFIG_VARIABLE, *(entry[1] for entry in KEYS.values())):
        old = deprecated_name(variable)
        if old not in environ:
            continue
        current.setdefault(variable, environ[old])
        ignored = f" (ignored: {variable} is set too)" if variable in environ else ""
        warnings.append(
            f"{old} is deprecated: vLLM reports every VLLM_* variable it does not know (and "
            f"refuses to start on one with --fail-on-environ-validation); rename it to "
            f"{variable}{ignored}"
        )
    return current, tuple(warnings)


def load_settings(
    options: Mapping[str, object], environ: Mapping[str, str], errors: list[str] | None = None
) -> Settings:
    """Merge the layers; `options` maps keys (and "config") to raw values. With `errors`
    (doctor's), a broken layer is left out, its message kept there: the rest applies."""
    given = ours_set(environ)
    environ, deprecated = with_current_names(given)
    explicit_config = options.get("config") or environ.get(CONFIG_VARIABLE)
    assert explicit_config is None or isinstance(explicit_config, str)  # the option is text
    values: dict[str, object] = {}
    read: list[str] = []
    tuned: list[Tuned] = []
    sources: dict[str, str] = {}
    iomp_from = Given.DEFAULT
    for path in (SYSTEM_CONFIG, explicit_config or user_config_path(environ)):
        if path is None or (path != explicit_config and not os.path.exists(path)):
            continue
        loaded = salvage(errors, read_layer, path)
        if loaded is not None:
            file_values, file_tuned = loaded
            tuned = [*file_tuned, *tuned]  # this file's take precedence over the ones before
            values.update(file_values)
            sources.update(dict.fromkeys(file_values, path))
            iomp_from = Given.CONFIG if "iomp" in file_values else iomp_from
            read.append(path)
    for key, (option, variable, parse) in KEYS.items():
        named = variable
        if variable not in given and deprecated_name(variable) in given:
            named = f"{deprecated_name(variable)} (deprecated name of {variable})"
        for layer, name, where in ((environ, variable, named), (options, key, option)):
            value = salvage(errors, parse, layer[name], where) if name in layer else None
            if value is not None:
                values[key] = value
                sources[key] = where
                if key == "iomp":
                    iomp_from = Given.VARIABLE if layer is environ else Given.OPTION
    return Settings(
        **values,  # type: ignore[arg-type]
        config_files=tuple(read),
        iomp_from=iomp_from,
        tuned=tuple(tuned),
        deprecated=deprecated,
        sources=tuple(sources.items()),
    )


def read_layer(path: str) -> tuple[dict[str, object], list[Tuned]]:
    """A config file's settings and tune records, whose scopes are read here: one from the
    vLLM --config its command names, refused by the trust rule, is this file's error."""
    content = read_config_file(path)
    records = tuned_in_file(content, path)
    for item in records:
        record_scope(item)
    return content, records


def tuned_in_file(content: dict[str, object], path: str) -> list[Tuned]:
    """The file's tune records, each with its origin; `content` loses the key. The global
    `iomp:` an unscoped record wrote beside it is the record's, unless edited since."""
    records = content.pop("tuned", ())
    assert isinstance(records, tuple)
    kept = []
    for item in records:
        if item.scope is None and "iomp" in content:
            if item.iomp != content["iomp"]:
                continue  # edited since: the value is the user's own
            del content["iomp"]
        kept.append(replace(item, origin=path))
    return kept


# Which `tune --write` record applies to a launch


def launch_scope(
    model: str | None, speculative: SpeculativeRequest, release: str | None, cpus: int
) -> Scope:
    """The scope of this launch: what a tune of it would have measured."""
    return Scope(normal_model(model), speculative.method, speculative.tokens, release, cpus or None)


def normal_model(model: str | None) -> str | None:
    """A local model directory by its absolute path (a tune may run from elsewhere)."""
    return os.path.abspath(model) if model and os.path.isdir(model) else model


def record_scope(tuned: Tuned) -> Scope:
    """A record's scope; one written before scoping, from the command it records."""
    if tuned.scope is not None:
        return tuned.scope
    import shlex  # lazy: only for a record written before scoping (shlex imports re)

    try:
        argv = shlex.split(tuned.command)
    except ValueError:
        argv = []
    arguments = argv[1:] if argv[:1] == ["vllm"] else argv
    command = read_command(arguments)
    request = command.speculative
    return Scope(normal_model(command.model), request.method, request.tokens)


def differences(recorded: Scope, launch: Scope) -> list[str]:
    """Where the launch leaves what the record measured (a field it did not record: any)."""
    found = []
    for field, label in LABELS.items():
        wanted, actual = getattr(recorded, field), getattr(launch, field)
        if wanted is not None and wanted != actual:
            found.append(f"{label} {'unknown' if actual is None else actual}, not {wanted}")
    return found


def describe(scope: Scope) -> str:
    """`model /m, SD method ngram, draft tokens 3, vLLM 0.32.0, CPUs 2` (what is recorded)."""
    parts = [
        f"{label} {getattr(scope, key)}" for key, label in LABELS.items() if getattr(scope, key)
    ]
    return ", ".join(parts) or "any command"


def choose(settings: Settings, launch: Scope) -> tuple[Tuned | None, list[str]]:
    """The tune record that applies to this launch (None: none), and a note on each one.
    Of several that match, the one that recorded the most wins, then the earlier one."""
    notes = []
    matching = []
    for tuned in settings.tuned:
        scope = record_scope(tuned)
        missed = differences(scope, launch)
        others = [f"{iomp} at {n}" for n, iomp in tuned.concurrency if iomp != tuned.iomp]
        if others:
            held = f"its iomp: {tuned.iomp} did not hold at every concurrency"
            missed.append(f"{held} ({', '.join(others)})")
        elif not missed and settings.iomp_from in (Given.OPTION, Given.VARIABLE):
            missed = [f"{said_setting(settings, 'iomp')} given, which wins"]
        if missed:
            notes.append(f"{tune_named(tuned, scope)} not applied: {'; '.join(missed)}")
        else:
            matching.append((tuned, scope))
    if not matching:
        return None, notes
    chosen, scope = max(
        matching, key=lambda pair: sum(v is not None for v in vars(pair[1]).values())
    )
    notes.append(f"{tune_named(chosen, scope)} applied")
    notes += [
        f"{tune_named(t, s)} matches too, but the applied one recorded more or comes first"
        for t, s in matching
        if t is not chosen
    ]
    return chosen, notes


def tune_named(tuned: Tuned, scope: Scope) -> str:
    """A record as each note names it: when, where it applies, and which file holds it."""
    return f"tune of {tuned.when} ({describe(scope)}; {tuned.origin})"


def record_fields(tuned: Tuned, scope: Scope) -> dict[str, object]:
    """A record as a config file holds it and doctor shows it, with its scope."""
    fields = {key: getattr(tuned, key) for key in TUNED_FIELDS} | {
        "iomp": tuned.iomp.value,  # YAML writes words, not members
        "scope": {key: getattr(scope, key) for key in LABELS},
    }
    if tuned.concurrency:
        fields["concurrency"] = {level: iomp.value for level, iomp in tuned.concurrency}
    return fields
