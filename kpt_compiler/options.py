"""Compile options: one validated, frozen object built from ``torch.compile(..., mode=, options=)``.

Every options class here and in the passes is a frozen dataclass, built from the user's dict by
``typed_options.build_options`` (errors that name the key, what was given and what is allowed). This module
resolves the whole dict: top-level keys, each pass's setting from its own key and its group's, ``disable``
and ``pipeline`` (refusing contradictions), and the environment variables.

Passes are looked up in the registry (``kpt_compiler.registry``); this module imports nothing from the
pipeline, the pass manager or the target.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any, Literal, Mapping

from .errors import OptionError
from .registry import expand_groups, registered_groups, registered_passes
from .typed_options import build_options, coerce, describe_type, options_to_dict, unknown_key_error

__all__ = ["OptionError", "CompileOptions", "build_options", "parse_options", "MODES"]

# The modes torch.compile documents, with the meaning Inductor gives them (torch._inductor.list_mode_options).
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

ENV_DUMP_DIR = "KPT_DUMP_DIR"  # sets dump_dir when the options do not
ENV_DISABLE = "KPT_DISABLE"  # comma-separated pass names to switch off, for bisecting without editing code
ENV_STRICT = "KPT_STRICT"  # 1/true/yes/on: a failing pass raises instead of stepping aside (0/false/no/off: not)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """Everything one ``torch.compile(..., backend="kernelpytorch")`` call asked for, validated.

    ``passes`` maps each registered pass name to ``(enabled, its options dataclass)``. Users do not fill it
    directly: ``options={"attention": False}`` or ``options={"fusion": {"decide": "measure"}}`` do. ``disable``
    and ``pipeline`` may name groups (``"fusion"``) as well as passes.
    """

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    device: Literal["auto", "cuda", "cpu", "xla"] = "auto"
    codegen: Literal["auto", "inductor", "eager"] = "auto"
    dump_dir: str | None = None
    strict: bool = False
    disable: tuple[str, ...] = ()
    pipeline: tuple[str, ...] | None = None
    inductor: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    passes: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))
    # names from the KPT_DISABLE environment variable (not an option: it switches passes off without editing the
    # code that compiles, to bisect; it wins over the options, and the report says it did)
    env_disable: tuple[str, ...] = ()

    def __post_init__(self):
        known = list(registered_passes()) + list(registered_groups())
        for name in self.disable:
            if _pass_name(name) not in known:
                raise unknown_key_error(name, known, "options['disable'] (pass and group names)")
        for name in self.env_disable:
            if _pass_name(name) not in known:
                raise unknown_key_error(name, known, f"the environment variable {ENV_DISABLE} (pass and group names)")
        if self.pipeline is not None:
            groups = registered_groups()
            seen: dict[str, str] = {}  # pass name -> the entry of the pipeline that named it
            for name in self.pipeline:
                if _pass_name(name) not in known:
                    raise unknown_key_error(name, known, "options['pipeline'] (pass and group names)")
                group = groups.get(_pass_name(name))
                for member in group.members if group else (_pass_name(name),):
                    if member in seen:
                        twice = f"pass {name!r}" if seen[member] == name else \
                            f"pass {member!r} twice (through {seen[member]!r} and {name!r})"
                        raise OptionError(f"options['pipeline'] names {twice}" if seen[member] != name
                                          else f"options['pipeline'] names {twice} twice")
                    seen[member] = name
        if self.inductor:
            from torch._inductor import config as inductor_config

            valid = list(inductor_config.get_config_copy())
            for key, value in self.inductor.items():
                if key not in valid:
                    raise unknown_key_error(key, valid, "options['inductor'] (torch._inductor.config)")
                _check_inductor_value(inductor_config, key, value)

    # ------------------------------------------------------------------ queries the pipeline asks
    def pass_enabled(self, name: str) -> bool:
        return self.passes[name].enabled and not self.disabled_by_name(name)

    def disabled_by_name(self, name: str) -> bool:
        """Whether ``disable`` (or KPT_DISABLE) names the pass or a group it belongs to."""
        return name in _expand({_pass_name(n) for n in (*self.disable, *self.env_disable)})

    def disabled_by_env(self, name: str) -> bool:
        return name in _expand({_pass_name(n) for n in self.env_disable})

    def pass_options(self, name: str) -> Any:
        return self.passes[name].options

    def to_dict(self) -> dict[str, Any]:
        """A dict that ``parse_options(None, d)`` turns back into an equal object: passes appear only where the
        user set them or they differ from their default."""
        out = {k: v for k, v in options_to_dict(self).items() if k not in ("passes", "env_disable")}
        specs = registered_passes()
        for name, setting in self.passes.items():
            if not setting.explicit and setting.enabled == specs[name].default:
                continue
            has_fields = bool(dataclasses.fields(setting.options))
            out[name.replace("-", "_")] = options_to_dict(setting.options) if setting.enabled and has_fields else setting.enabled
        return out


@dataclasses.dataclass(frozen=True)
class PassSetting:
    """One pass as the options left it: on or off, its options object, whether the user asked for it, and
    under which key (the pass's own, or its group's)."""

    enabled: bool
    options: Any
    explicit: bool = False
    key: str | None = dataclasses.field(default=None, compare=False)


def _pass_name(key: str) -> str:
    return key.replace("_", "-")


_TOP_LEVEL = [f.name for f in dataclasses.fields(CompileOptions) if f.name not in ("passes", "env_disable")]


def _expand(names) -> set[str]:
    return set(expand_groups(names))


def _env_flag(name: str) -> bool | None:
    """A boolean environment variable in any of the usual spellings (None when unset or empty); anything else is
    an error."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise OptionError(f"the environment variable {name}={raw!r} must be one of {'/'.join(_TRUE)} or "
                      f"{'/'.join(_FALSE)} (any case); unset it for the default")


def _check_inductor_value(config, key: str, value: Any) -> None:
    """options['inductor'][key] against the type torch._inductor.config declares for it (where it is one the
    options' own checks understand: bools, numbers, strings, lists, unions of them)."""
    entry = getattr(config, "_config", {}).get(key)
    expected = getattr(entry, "value_type", None)
    if expected is None or expected is type(None):  # no annotation: the type of a None default says nothing
        return
    try:
        ok, _ = coerce(value, expected)
    except TypeError:  # a type isinstance cannot check (Callable, generics): Inductor checks it itself
        return
    if not ok:
        raise OptionError(f"option {key!r} in options['inductor'] must be {describe_type(expected)} (the type of "
                          f"torch._inductor.config.{key}); got {value!r} ({type(value).__name__})")


def parse_options(mode: str | None, options: Mapping[str, Any] | None) -> CompileOptions:
    """Turn torch.compile's ``mode`` and ``options`` into a CompileOptions, or raise OptionError."""
    if options is not None and not isinstance(options, Mapping):
        raise OptionError(f"options must be a dict, got {type(options).__name__}")
    options = dict(options or {})
    if mode is not None and mode != "default":
        if "mode" in options and options["mode"] != mode:
            raise OptionError(f"mode={mode!r} and options['mode']={options['mode']!r} disagree; give one")
        options["mode"] = mode
    if ENV_DUMP_DIR in os.environ and "dump_dir" not in options:
        options["dump_dir"] = os.environ[ENV_DUMP_DIR] or None
    if "strict" not in options:  # the options win; the variable is read only where they do not say
        strict = _env_flag(ENV_STRICT)
        if strict is not None:
            options["strict"] = strict
    env_disable = [n.strip() for n in os.environ.get(ENV_DISABLE, "").split(",") if n.strip()]
    if isinstance(options.get("pipeline"), str):
        options["pipeline"] = [n.strip() for n in options["pipeline"].split(",") if n.strip()]

    known, groups = registered_passes(), registered_groups()
    top, pass_given, group_given = {}, {}, {}
    for key, value in options.items():
        if not isinstance(key, str):
            raise OptionError(f"option keys must be strings, got {key!r}")
        if key in _TOP_LEVEL:
            top[key] = value
        elif _pass_name(key) in known:
            pass_given[_pass_name(key)] = value
        elif _pass_name(key) in groups:
            group_given[_pass_name(key)] = value
        else:
            raise _unknown_top_level(key, _TOP_LEVEL + [n.replace("-", "_") for n in [*known, *groups]])

    from_groups = {m: s for name, value in group_given.items() for m, s in _group_settings(groups[name], value).items()}
    passes: dict[str, PassSetting] = {}
    for name, spec in known.items():
        passes[name] = _pass_setting(spec, pass_given.get(name, _MISSING), from_groups.get(name))
    _refuse_contradictions(top, passes, pass_given)
    _enable_the_named_pipeline(top, passes, pass_given, group_given)
    return build_options(CompileOptions, {**top, "passes": passes, "env_disable": env_disable}, "options")


def _asked_by(name: str, pass_given: dict) -> str | None:
    """The key under which the user asked for this pass by its own name (True or a dict), or None. A group's
    setting asks for no member in particular: it may go with one of them switched off."""
    value = pass_given.get(name, _MISSING)
    return name.replace("-", "_") if value is True or isinstance(value, Mapping) else None


def _refuse_contradictions(top: dict, passes: dict, pass_given: dict) -> None:
    """A pass asked for by its own name and also switched off, or left out of ``pipeline``, is a contradiction:
    refuse it, naming both keys. So is one name in both ``pipeline`` and ``disable`` (or a pass named in
    ``pipeline`` whose group ``disable`` names). A group in one and a member in the other is no contradiction:
    the member's own setting is the more specific."""
    disabled = [_pass_name(d) for d in top.get("disable") or () if isinstance(d, str)]
    named = [_pass_name(p) for p in top.get("pipeline") or () if isinstance(p, str)]
    for entry in disabled:
        for name in sorted(_expand({entry}) & set(passes)):
            key = _asked_by(name, pass_given)
            if key is not None:
                raise OptionError(f"options[{key!r}] asks for pass {name!r} and options['disable'] names "
                                  f"{entry!r}: give one of them")
        for p in named:
            if p == entry or (p in passes and p in _expand({entry})):
                raise OptionError(f"options['pipeline'] names {p!r} and options['disable'] names {entry!r}: "
                                  "give one of them")
    if top.get("pipeline") is not None:
        running = _expand(set(named))
        for name in sorted(set(pass_given) - running):
            key = _asked_by(name, pass_given)
            if key is not None:
                raise OptionError(f"options[{key!r}] asks for pass {name!r}, which options['pipeline'] leaves "
                                  "out: add it there, or drop the setting")


def _enable_the_named_pipeline(top: dict, passes: dict, pass_given: dict, group_given: dict) -> None:
    """``pipeline`` runs exactly the passes it names: one off by default is switched on (as if asked for). One
    named there that the options switch off (its own key, or its group's False) is a contradiction; a member of
    a named group that the options switch off stays off."""
    for entry in [_pass_name(p) for p in top.get("pipeline") or () if isinstance(p, str)]:
        if group_given.get(entry) is False:
            raise OptionError(f"options['pipeline'] names {entry!r} and options[{entry.replace('-', '_')!r}] is "
                              "False: give one of them")
        for name in sorted(_expand({entry}) & set(passes)):
            setting = passes[name]
            if setting.enabled:
                continue
            if name == entry and (name in pass_given or setting.key is not None):
                key = name.replace("-", "_") if name in pass_given else setting.key
                raise OptionError(f"options['pipeline'] names {entry!r} and options[{key!r}] switches it off: "
                                  "give one of them")
            if name != entry and (name in pass_given or setting.key is not None):
                continue  # a member of a named group, switched off by its own key or a group toggle
            passes[name] = dataclasses.replace(setting, enabled=True, explicit=True, key="pipeline")


@dataclasses.dataclass(frozen=True)
class _FromGroup:
    """What a group's setting says of one member: on or off, and the group options passed on to it."""

    enabled: bool | None  # None: the group's setting leaves it at its default
    shared: dict[str, Any]
    key: str


def _group_settings(group, value: Any) -> dict[str, _FromGroup]:
    where = f"options[{group.key!r}]"
    if isinstance(value, bool):
        return {m: _FromGroup(value, {}, group.key) for m in group.members}
    if not isinstance(value, Mapping):
        raise OptionError(f"option {group.key!r} must be True, False or a dict of the group's options "
                          f"({_field_list(group.options)}); got {value!r}")
    gopts = build_options(group.options, value, where)
    given = {k.replace("-", "_") for k in value}
    shared = {k: v for k, v in group.shared(gopts).items() if k in given}
    return {m: _FromGroup(group.member_enabled(gopts, m), shared, group.key) for m in group.members}


def _pass_setting(spec, value: Any, group: _FromGroup | None) -> PassSetting:
    """A pass's setting from its own key's value and its group's, the pass's own winning where both speak."""
    where = f"options[{spec.key!r}]"
    fields = {f.name for f in dataclasses.fields(spec.options)}
    shared = {k: v for k, v in group.shared.items() if k in fields} if group else {}
    if value is _MISSING and group is None:
        return PassSetting(spec.default, build_options(spec.options, {}, where))
    # a pass switched off keeps its default options (what it would run with says nothing, and to_dict drops it)
    if value is _MISSING:
        enabled = spec.default if group.enabled is None else group.enabled
        group_where = f"options[{group.key!r}] (for pass {spec.name!r})"
        return PassSetting(enabled, build_options(spec.options, shared if enabled else {}, group_where),
                           explicit=bool(group.enabled), key=group.key)
    if isinstance(value, bool):
        return PassSetting(value, build_options(spec.options, shared if value else {}, where), explicit=value,
                           key=spec.key)
    if isinstance(value, Mapping):
        return PassSetting(True, build_options(spec.options, {**shared, **value}, where), explicit=True, key=spec.key)
    raise OptionError(
        f"option {spec.key!r} must be True, False or a dict of the pass's options"
        f" ({_field_list(spec.options)}); got {value!r}"
    )


def _field_list(cls: type) -> str:
    names = [f.name for f in dataclasses.fields(cls)]
    return ", ".join(names) if names else "it has none"


def _unknown_top_level(key: str, valid: list[str]) -> OptionError:
    try:
        from torch._inductor import config as inductor_config

        if key.replace("-", "_") in inductor_config.get_config_copy():
            return OptionError(
                f"{key!r} is an Inductor option, not a kernelpytorch one: pass it as "
                f"options={{'inductor': {{{key!r}: ...}}}}. Valid kernelpytorch options: {', '.join(sorted(valid))}."
            )
    except ImportError:  # pragma: no cover - torch always has Inductor
        pass
    return unknown_key_error(key, valid, "options")
