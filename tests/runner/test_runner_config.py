"""Tests of job-config processing: references, resolution order, registries and every error."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from fedlink.common.dxo import DXO
from fedlink.common.errors import InvalidArgument
from fedlink.runner import (
    ComponentResolver,
    Context,
    JobConfigError,
    NoExecutorForTask,
    ResolverRegistry,
    Signal,
    process_job_data,
)
from fedlink.runner.builtins import BUILTIN_TYPES, builtin_registry
from fedlink.runner.executors import SoftmaxRegressionTrainer
from fedlink.runner.filters import GaussianPrivacy, TopKSparsification
from fedlink.runner.handlers import LossRecorder


class Part:
    """A component that records the order in which parts are built."""

    built: list[str] = []  # noqa: RUF012 - reset by each test that reads it

    def __init__(self, label: str, **kwargs: Any) -> None:
        self.label = label
        self.kwargs = kwargs
        Part.built.append(label)


class EchoExecutor:
    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        return dxo


class Explodes:
    def __init__(self, size: int = 1) -> None:
        raise TypeError("size must be even")


def _registry() -> ResolverRegistry:
    return ResolverRegistry({"Part": Part, "Echo": EchoExecutor, "Explodes": Explodes})


def test_references_resolve_in_dependency_order_at_any_depth() -> None:
    Part.built = []
    job = {
        "components": [
            {
                "type": "Part",
                "name": "top",
                "args": {"label": "top", "deep": {"xs": ["@mid", {"y": "@leaf"}]}},
            },
            {"type": "Part", "name": "mid", "args": {"label": "mid", "child": "@leaf"}},
            {"type": "Part", "name": "leaf", "args": {"label": "leaf"}},
            {"type": "Part", "name": "alone", "args": {"label": "alone"}},
        ],
        "executors": {"*": "@run"},
    }
    job["components"].append({"type": "Echo", "name": "run"})  # type: ignore[attr-defined]
    config = process_job_data(json.dumps(job), _registry())
    assert Part.built == ["leaf", "mid", "top", "alone"]
    top, mid, leaf = (config.components[n] for n in ("top", "mid", "leaf"))
    assert isinstance(top, Part) and isinstance(mid, Part)
    assert top.kwargs["deep"]["xs"][0] is mid
    assert top.kwargs["deep"]["xs"][1]["y"] is leaf
    assert mid.kwargs["child"] is leaf  # one object per component, shared by every reference


def test_builtins_build_from_a_json_string() -> None:
    job = {
        "components": [
            {"type": "SoftmaxRegressionTrainer", "name": "trainer", "args": {"epochs": 2, "seed": 3}},
            {"type": "GaussianPrivacy", "name": "dp", "args": {"clip_norm": 1.0}},
            {"type": "TopKSparsification", "name": "topk", "args": {"fraction": 0.1}},
            {"type": "LossRecorder", "name": "losses"},
        ],
        "executors": {"train": "@trainer", "evaluate": "@trainer"},
        "in_filters": [],
        "out_filters": ["@dp", "@topk"],
        "handlers": ["@losses"],
    }
    config = process_job_data(json.dumps(job))
    trainer = config.executor_for("train")
    assert isinstance(trainer, SoftmaxRegressionTrainer) and trainer.epochs == 2 and trainer.seed == 3
    assert config.executor_for("evaluate") is trainer
    assert [type(f) for f in config.out_filters] == [GaussianPrivacy, TopKSparsification]
    assert config.in_filters == ()
    assert isinstance(config.handlers[0], LossRecorder)


def test_star_executor_is_the_fallback_and_a_named_task_wins() -> None:
    job = {
        "components": [
            {"type": "Echo", "name": "any", "args": {"tag": "any"}},
            {"type": "Echo", "name": "special", "args": {"tag": "special"}},
        ],
        "executors": {"*": "@any", "train": "@special"},
    }
    config = process_job_data(job, _registry())
    assert config.executor_for("train") is config.components["special"]
    assert config.executor_for("evaluate") is config.components["any"]


def test_no_executor_for_a_task_names_the_task_and_the_known_ones() -> None:
    job = {"components": [{"type": "Echo", "name": "e"}], "executors": {"train": "@e"}}
    config = process_job_data(job, _registry())
    with pytest.raises(NoExecutorForTask, match=r"task 'evaluate' \(executors: 'train'\)") as info:
        config.executor_for("evaluate")
    assert isinstance(info.value, InvalidArgument)


def test_legacy_component_named_trainer_serves_every_task() -> None:
    config = process_job_data({"components": [{"type": "Echo", "name": "trainer"}]}, _registry())
    assert config.executor_for("anything") is config.components["trainer"]


def test_app_registry_overrides_a_builtin_of_the_same_name() -> None:
    registry = ResolverRegistry({"SoftmaxRegressionTrainer": EchoExecutor})
    job = {
        "components": [{"type": "SoftmaxRegressionTrainer", "name": "t", "args": {"tag": "mine"}}],
        "executors": {"*": "@t"},
    }
    executor = process_job_data(job, registry).executor_for("train")
    assert isinstance(executor, EchoExecutor) and executor.tag == "mine"
    assert builtin_registry().get("SoftmaxRegressionTrainer") is SoftmaxRegressionTrainer


def test_builtin_registry_holds_the_documented_names() -> None:
    assert (
        set(builtin_registry())
        == set(BUILTIN_TYPES)
        >= {
            "LinearRegressionTrainer",
            "SoftmaxRegressionTrainer",
            "MLPTrainer",
            "GaussianPrivacy",
            "Float16Compression",
            "TopKSparsification",
            "ExcludeVariables",
            "ArrayDataSource",
            "NpzDataSource",
            "CsvDataSource",
            "PartitionedDataSource",
            "LossRecorder",
        }
    )


class _PairResolver(ComponentResolver):
    def resolve(self) -> object:
        return (self.component_type, self.name, self.args["value"])


def test_component_resolver_subclasses_build_native_objects() -> None:
    registry = ResolverRegistry({"Pair": _PairResolver, "Part": Part})
    job = {
        "components": [
            {"type": "Pair", "name": "p", "args": {"value": 7}},
            {"type": "Part", "name": "user", "args": {"label": "u", "pair": "@p"}},
        ]
    }
    config = process_job_data(job, registry)
    user = config.components["user"]
    assert isinstance(user, Part) and user.kwargs["pair"] == ("Pair", "p", 7)


def _component(type_: str, name: str, **args: Any) -> dict[str, Any]:
    return {"type": type_, "name": name, "args": args}


ERRORS: list[tuple[str, Any, list[str]]] = [
    ("invalid JSON", '{"components": [', ["not valid JSON"]),
    ("not an object", "[1, 2]", ["must be a JSON object", "list"]),
    ("unknown top-level key", {"components": [], "executor": {}}, ["unknown key(s) ['executor']"]),
    ("components missing", {"executors": {}}, ["'components' must be a list", "NoneType"]),
    ("components not a list", {"components": {"a": 1}}, ["'components' must be a list", "dict"]),
    ("entry not an object", {"components": ["x"]}, ["components[0] must be an object"]),
    (
        "entry missing type",
        {"components": [{"name": "a"}]},
        ["components[0] needs a non-empty string 'type'"],
    ),
    (
        "entry missing name",
        {"components": [{"type": "Part"}]},
        ["components[0] needs a non-empty string 'name'"],
    ),
    (
        "entry unknown key",
        {"components": [{"type": "Part", "name": "a", "arg": {}}]},
        ["components[0]", "'arg'"],
    ),
    (
        "args not an object",
        {"components": [_component("Echo", "e"), {"type": "Part", "name": "p", "args": [1]}]},
        ["components[1] ('p')", "'args' must be an object"],
    ),
    (
        "duplicate names",
        {"components": [_component("Echo", "e"), _component("Echo", "e")]},
        ["components[1] ('e')", "duplicate component name 'e'"],
    ),
    (
        "unknown type",
        {"components": [_component("Nope", "mystery")]},
        ["component 'mystery'", "unknown type 'Nope'", "Echo"],
    ),
    (
        "missing reference",
        {"components": [_component("Part", "p", label="x", deps=[{"a": "@ghost"}])]},
        ["component 'p'", "'@ghost'"],
    ),
    (
        "reference cycle",
        {
            "components": [
                _component("Part", "a", label="a", next="@b"),
                _component("Part", "b", label="b", next=["@c"]),
                _component("Part", "c", label="c", next={"n": "@a"}),
            ]
        },
        ["cycle: a -> b -> c -> a"],
    ),
    ("self reference", {"components": [_component("Part", "me", label="@me")]}, ["cycle: me -> me"]),
    (
        "constructor rejects args",
        {"components": [_component("SoftmaxRegressionTrainer", "trainer", lr=0.1)]},
        ["component 'trainer' (type 'SoftmaxRegressionTrainer')", "'lr'", "learning_rate"],
    ),
    (
        "constructor raises TypeError",
        {"components": [_component("Explodes", "boom", size=3)]},
        ["component 'boom' (type 'Explodes') rejected its args", "size must be even"],
    ),
    (
        "constructor raises InvalidArgument",
        {"components": [_component("SoftmaxRegressionTrainer", "t", epochs=0)]},
        ["component 't'", "epochs must be an integer >= 1"],
    ),
    (
        "executors not a mapping",
        {"components": [_component("Echo", "e")], "executors": ["@e"]},
        ["'executors' must be an object"],
    ),
    (
        "executor not a reference",
        {"components": [_component("Echo", "e")], "executors": {"train": "e"}},
        ["executors['train']", "reference like '@name'"],
    ),
    (
        "executor reference missing",
        {"components": [_component("Echo", "e")], "executors": {"train": "@nobody"}},
        ["executors['train']", "'@nobody'"],
    ),
    (
        "executor not an Executor",
        {"components": [_component("GaussianPrivacy", "dp", clip_norm=1.0)], "executors": {"train": "@dp"}},
        ["executors['train'] = '@dp'", "GaussianPrivacy, not an Executor"],
    ),
    (
        "filters not a list",
        {"components": [_component("Float16Compression", "f")], "in_filters": "@f"},
        ["'in_filters' must be a list"],
    ),
    (
        "filter not a Filter",
        {
            "components": [_component("Echo", "e"), _component("Float16Compression", "f")],
            "out_filters": ["@f", "@e"],
        },
        ["out_filters[1] = '@e'", "EchoExecutor, not a Filter"],
    ),
    (
        "handler not an EventHandler",
        {"components": [_component("Echo", "e")], "handlers": ["@e"]},
        ["handlers[0] = '@e'", "not an EventHandler"],
    ),
]


@pytest.mark.parametrize(("case", "job_data", "expected"), ERRORS, ids=[e[0] for e in ERRORS])
def test_config_errors_name_the_offending_entry(case: str, job_data: Any, expected: list[str]) -> None:
    with pytest.raises(JobConfigError) as info:
        process_job_data(job_data, _registry())
    assert isinstance(info.value, InvalidArgument)
    for fragment in expected:
        assert fragment in info.value.message, f"{case}: {fragment!r} not in {info.value.message!r}"


def test_registry_refuses_non_callables() -> None:
    with pytest.raises(InvalidArgument, match="'Thing'"):
        ResolverRegistry({"Thing": 3})  # type: ignore[dict-item]


def test_a_factory_closing_over_a_model_is_not_kept_alive_by_the_config() -> None:
    # A registry made per job, its factory closing over that job's model (as an app or a bench does):
    # once the job's config is gone, so is the model (the signature cache held 1,024 factories before,
    # a 100 MB model with each).
    class Model:
        pass

    def trainer_of(model: Model) -> Callable[..., EchoExecutor]:
        def trainer(tag: str = "") -> EchoExecutor:
            assert model is not None
            return EchoExecutor(tag=tag)

        return trainer

    model = Model()
    gone = weakref.ref(model)
    factory = trainer_of(model)
    del model  # the factory's closure holds it now, and only that
    job = {"components": [{"type": "Trainer", "name": "t", "args": {"tag": "x"}}], "executors": {"*": "@t"}}
    config = process_job_data(job, ResolverRegistry({"Trainer": factory}))
    assert isinstance(config.executor_for("train"), EchoExecutor)
    assert gone() is not None
    del config, factory
    gc.collect()
    assert gone() is None
