"""Fuzzing config overrides and files: any `key=value` list or YAML text gives a valid config or a
one-line ConfigError (what `agent-r1 <command>` prints as `error: ...`), never another exception.

`agent-r1 train`'s config is the target: nested sections, literals, optionals, tuples, a dict section
(`val.task`) and a task whose options depend on its name. Task names are drawn from a safe set (built-in
tasks, broken names, attributes of the calculator module): `task=NAME` imports NAME, and a fuzzer must not
import whatever module a random string happens to name.
"""

from __future__ import annotations

import pytest
import yaml
from hypothesis import event, given, settings
from hypothesis import strategies as st

from agent_r1.config import ConfigError, build, describe, load_config, to_dict
from agent_r1.trainer.config import TrainConfig
from tests.conftest import examples

KEYS = [line.split(" = ")[0].strip() for line in describe(TrainConfig).splitlines()]  # every real key
TASK_KEYS = ("task", "task.name")

YAML_PIECES = [
    "[", "]", "{", "}", ",", ": ", " ", "- ", "'", '"', "&a ", "*a", "!!", "!!python/object:os.system ", "!!binary ",
    "? ", "|", ">", "#", "%", "@", "`", "\\", "\n", "\t", "\x00", "\ud800", "null", "~", "true", "no", "on", "1", "-1",
    "0x1f", "1e-4", "2e-4", ".5", ".nan", ".inf", "-.inf", "1_000", "2001-01-01", "grpo", "ppo", "fp32", "auto",
    "calculator", "ops", "x",
]  # fmt: skip
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=3),
    max_leaves=8,
)
yaml_values = st.one_of(
    st.text(),
    st.lists(st.sampled_from(YAML_PIECES) | st.text(max_size=3), max_size=12).map("".join),
    json_values.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()),  # valid YAML
    st.integers(4000, 6000).map(lambda n: "9" * n),  # more digits than Python turns into an int
    st.integers(1, 600).map(lambda n: "[" * n),  # from ~500 deeper than YAML's recursive parser goes
)
keys = st.one_of(
    st.sampled_from(KEYS),
    st.tuples(st.sampled_from(KEYS), st.text(max_size=4)).map("".join),  # typos, extra parts, newlines
    st.lists(st.sampled_from(["task", "val", "algo", "ops", "name", "", "\n"]), min_size=1, max_size=4).map(".".join),
    st.text(max_size=12),
)


def flatten(raw: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in raw.items():
        out |= flatten(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {f"{prefix}{key}": value}
    return out


DEFAULTS = flatten(to_dict(TrainConfig()))  # every real key and its default


def like(default) -> st.SearchStrategy:
    """Values of the default's own type: what a user means to write, though not always a valid one."""
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(-2, 100) | st.integers()
    if isinstance(default, float):
        return st.floats()
    if isinstance(default, str):
        return st.just(default) | st.sampled_from(YAML_PIECES) | st.text(max_size=8)
    if isinstance(default, list | tuple):
        return st.lists(like(default[0]) if default else st.integers(), max_size=3)
    if isinstance(default, dict):
        return st.dictionaries(st.sampled_from([*DEFAULTS, "ops", "data", "x"]), json_values, max_size=2)
    return st.none() | st.integers() | st.floats() | st.text(max_size=8)


def as_yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()


typed_overrides = st.sampled_from(sorted(set(DEFAULTS) - set(TASK_KEYS))).flatmap(
    lambda key: like(DEFAULTS[key]).map(lambda value: f"{key}={as_yaml(value)}")
)
SAFE_TASK_NAMES = [
    "calculator", "gsm8k", "hotpotqa", "", ".", ".calculator", "..x", ":", "calculator:", "calculator:tasks",
    "agent_r1.tasks.calculator", "agent_r1.tasks.calculator:Options", "agent_r1.tasks.calculator:nope",
    "agent_r1.tasks", "agent_r1", "nope.py", "/nonexistent/task.py", "agent_r1/tasks/calculator.py",
    "{name: gsm8k, data: x.jsonl}", "{name: hotpotqa, retriever: ftp}", "[calculator]", "null", "1",
]  # fmt: skip
task_names = st.one_of(
    st.sampled_from(SAFE_TASK_NAMES),
    st.text(max_size=8).map(lambda s: "." + s),  # relative imports
    st.text(max_size=8).map(lambda s: "agent_r1.tasks.calculator:" + s),  # any attribute of a real module
    st.text(max_size=8).map(lambda s: "no_such_task_" + s),
)
overrides = st.one_of(
    typed_overrides,
    st.tuples(keys, yaml_values).map("=".join).filter(lambda item: item.partition("=")[0] not in TASK_KEYS),
    st.tuples(st.sampled_from(TASK_KEYS), task_names).map("=".join),
    st.text(max_size=12).filter(lambda item: "=" not in item),  # no '=' at all
)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return tmp_path_factory.mktemp("config") / "fuzzed.yaml"


def check(load) -> None:
    """`load()` gives a config that survives a save and reload, or a one-line ConfigError."""
    try:
        cfg = load()
    except ConfigError as exc:
        event("ConfigError")  # `--hypothesis-show-statistics` shows how often each outcome came up
        message = str(exc)
        assert message and len(message.splitlines()) == 1, message
        return
    event("valid config")
    assert isinstance(cfg, TrainConfig)
    assert repr(build(TrainConfig, to_dict(cfg))) == repr(cfg)  # repr: nan == nan


@settings(max_examples=examples(600), deadline=None)
@given(st.lists(overrides, max_size=5))
def test_any_overrides(items):
    check(lambda: load_config(TrainConfig, None, items))


@settings(max_examples=examples(200), deadline=None)
@given(
    st.one_of(
        yaml_values,
        st.lists(st.tuples(st.sampled_from(KEYS) | st.text(max_size=6), yaml_values), max_size=4).map(
            lambda pairs: "\n".join(f"{k}: {v}" for k, v in pairs)
        ),
    ).filter(lambda text: "task" not in text)
)
def test_any_config_file(config_file, text):
    config_file.write_text(text, errors="surrogatepass")
    check(lambda: load_config(TrainConfig, str(config_file)))


# --- the bugs fuzzing found, one plain test each --------------------------------------------------------


@pytest.mark.parametrize("value", ["[1", "a: b: c", "!!python/object:os.system x", "'", "\x00", "9" * 5000, "[" * 600])
def test_regression_a_value_yaml_cannot_read_is_a_config_error(value):
    """YAML's own multi-line error (or a ValueError, a RecursionError) came out of load_config."""
    with pytest.raises(ConfigError, match=r"^override [\"']steps=.* is not valid YAML: ") as err:
        load_config(TrainConfig, None, [f"steps={value}"])
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("item", ["optim={1: 2}", "optim={null: 2}", "val.task={1: 2}"])
def test_regression_a_key_that_is_not_a_string_is_unknown(item):
    """difflib raised TypeError looking for a valid key close to the int (or None) key."""
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(TrainConfig, None, [item])


def test_regression_an_int_too_large_for_a_float_is_a_config_error():
    """`lora.dropout=<a 400-digit int>` raised OverflowError converting the int to the float field."""
    with pytest.raises(ConfigError, match=r"lora\.dropout. must be float"):
        load_config(TrainConfig, None, ["lora.dropout=" + "2" * 400])


def test_regression_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    """A Latin-1 config file raised UnicodeDecodeError from `read_text`."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(TrainConfig, str(path))


def test_regression_a_newline_in_a_key_stays_one_line():
    with pytest.raises(ConfigError, match="unknown config key") as err:
        load_config(TrainConfig, None, ["stpes\nx=1"])
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("name", [".x", "..", "agent_r1.tasks.calculator:nope"])
def test_regression_bad_task_names_are_config_errors(name):
    """`task=.x` (a relative import) raised TypeError, `task=agent_r1.tasks.calculator:nope` AttributeError."""
    with pytest.raises(ConfigError, match="task"):
        load_config(TrainConfig, None, [f"task={name}"])
