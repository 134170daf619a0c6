"""App component types by import path (``pkg.module:Name``): loaded only from allowed modules; and the
checks of ``job_data`` a coordinator runs at submission, which build and import nothing."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from fedlink.runner.config import (
    ComponentNotAllowed,
    JobConfigError,
    ResolverRegistry,
    module_allowed,
    process_job_data,
)
from fedlink.runner.executors import SoftmaxRegressionTrainer
from fedlink.runner.settings import load_runner_settings
from fedlink.runner.validation import check_job_data, resolve_paths

#: The app's module, written to a temporary folder put on sys.path.
APP_MODULE = """
from subprocess import Popen

from fedlink.common.dxo import DXO
from fedlink.runner.executors import SoftmaxRegressionTrainer as Imported

IMPORTED_COUNT = 0


class Doubler:
    def __init__(self, factor: int = 2) -> None:
        self.factor = factor

    def execute(self, dxo, ctx, abort_signal):
        return DXO(kind=dxo.kind, data={k: v * self.factor for k, v in dxo.data.items()})


def make_doubler(**args):
    return Doubler(**args)


class _Hidden(Doubler):
    pass
"""


@pytest.fixture
def app_package(tmp_path: Path) -> Iterator[str]:
    """A package ``fedlink_test_app`` with a module ``nets`` holding the app's components."""
    package = tmp_path / "fedlink_test_app"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(textwrap.dedent(APP_MODULE))
    sys.path.insert(0, str(tmp_path))
    try:
        yield "fedlink_test_app"
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("fedlink_test_app")]:
            del sys.modules[name]


def job(component_type: str, **args: object) -> dict[str, object]:
    return {"components": [{"type": component_type, "name": "x", "args": args}], "executors": {"*": "@x"}}


# ---- loading on a device ----------------------------------------------------------------------------


def test_an_allowed_module_s_class_and_factory_are_built(app_package: str) -> None:
    config = process_job_data(
        job("fedlink_test_app.nets:Doubler", factor=3), allow_components=["fedlink_test_app.*"]
    )
    executor = config.executor_for("train")
    assert type(executor).__name__ == "Doubler" and executor.factor == 3  # type: ignore[attr-defined]
    built = process_job_data(
        job("fedlink_test_app.nets:make_doubler"), allow_components=["fedlink_test_app.nets"]
    )
    assert type(built.executor_for("train")).__name__ == "Doubler"


def test_a_module_not_allowed_is_refused_before_it_is_imported(app_package: str) -> None:
    for allowed in ([], ["otherpkg.*"], ["fedlink_test_app.other"]):
        with pytest.raises(ComponentNotAllowed) as info:
            process_job_data(job("fedlink_test_app.nets:Doubler"), allow_components=allowed)
        message = str(info.value)
        assert (
            "component 'x' has type 'fedlink_test_app.nets:Doubler' from module 'fedlink_test_app.nets'"
            in message
        )
        assert (
            "does not allow" in message and "allow_components" in message and "--allow-components" in message
        )
        assert "FEDLINK_ALLOW_COMPONENTS" in message
    assert "fedlink_test_app.nets" not in sys.modules  # refused before anything of it ran


def test_pkg_star_allows_the_package_itself_and_everything_under_it() -> None:
    assert module_allowed("mypkg", ["mypkg.*"])
    assert module_allowed("mypkg.nets.deep", ["mypkg.*"])
    assert not module_allowed("mypkgx", ["mypkg.*"])
    assert not module_allowed("other.mypkg", ["mypkg.*"])
    assert module_allowed("anything", ["*"])
    assert not module_allowed("mypkg", [])


def test_what_an_allowed_module_imported_from_elsewhere_is_refused(app_package: str) -> None:
    allowed = ["fedlink_test_app.*"]
    with pytest.raises(ComponentNotAllowed, match="defined in module 'subprocess'"):
        process_job_data(job("fedlink_test_app.nets:Popen", args=["true"]), allow_components=allowed)
    with pytest.raises(
        ComponentNotAllowed, match=r"defined in module 'fedlink\.runner\.executors\.regression'"
    ):
        process_job_data(job("fedlink_test_app.nets:Imported"), allow_components=allowed)
    for reach in ("fedlink_test_app.nets:Doubler.__init__.__globals__", "fedlink_test_app.nets:_Hidden"):
        with pytest.raises(JobConfigError, match="has no public class or factory"):
            process_job_data(job(reach), allow_components=allowed)


def test_a_type_that_cannot_be_imported_says_why(app_package: str) -> None:
    allowed = ["*"]
    with pytest.raises(JobConfigError, match=r"cannot import module 'no_such_module_xyz'.*PYTHONPATH"):
        process_job_data(job("no_such_module_xyz:Thing"), allow_components=allowed)
    with pytest.raises(JobConfigError, match="has no public class or factory 'Nothing'"):
        process_job_data(job("fedlink_test_app.nets:Nothing"), allow_components=allowed)
    with pytest.raises(JobConfigError, match=r"'IMPORTED_COUNT' of 'fedlink_test_app\.nets' is not a class"):
        process_job_data(job("fedlink_test_app.nets:IMPORTED_COUNT"), allow_components=allowed)
    with pytest.raises(JobConfigError, match="not a built-in type's name nor an import path"):
        process_job_data(job("my pkg:Thing"), allow_components=allowed)


def test_an_app_registry_entry_of_the_same_name_needs_no_allowing() -> None:
    registry = ResolverRegistry({"mypkg.nets:Trainer": SoftmaxRegressionTrainer})
    config = process_job_data(job("mypkg.nets:Trainer"), registry)  # mypkg does not even exist
    assert isinstance(config.executor_for("train"), SoftmaxRegressionTrainer)


def test_built_in_types_always_load_and_a_misspelt_one_gets_a_suggestion() -> None:
    assert isinstance(
        process_job_data(job("SoftmaxRegressionTrainer")).executor_for("x"), SoftmaxRegressionTrainer
    )
    with pytest.raises(
        JobConfigError,
        match=r"unknown type 'SoftmaxRegresionTrainer' \(did you mean 'SoftmaxRegressionTrainer'\?\)",
    ):
        process_job_data(job("SoftmaxRegresionTrainer"))


# ---- the runner's setting -----------------------------------------------------------------------------


def test_allow_components_comes_from_toml_env_and_flags_in_that_order(tmp_path: Path) -> None:
    config = tmp_path / "runner.toml"
    config.write_text('[runner]\nserver = "h:1"\nallow_components = ["from_toml.*"]\n')
    assert load_runner_settings(config, environ={}).allow_components == ("from_toml.*",)
    env = {"FEDLINK_ALLOW_COMPONENTS": "a.*, b.nets"}
    assert load_runner_settings(config, environ=env).allow_components == ("a.*", "b.nets")
    flags = {"allow_components": ["c.*", "d,e"]}
    assert load_runner_settings(config, environ=env, flags=flags).allow_components == ("c.*", "d", "e")
    assert load_runner_settings(environ={"FEDLINK_SERVER": "h:1"}).allow_components == ()


def test_a_bad_allow_components_value_names_the_setting(tmp_path: Path) -> None:
    config = tmp_path / "runner.toml"
    config.write_text('server = "h:1"\nallow_components = 3\n')
    with pytest.raises(Exception, match="allow_components"):
        load_runner_settings(config, environ={})


# ---- what the coordinator checks at submission ------------------------------------------------------


TRAINER = {"type": "SoftmaxRegressionTrainer", "name": "t"}


def refused(job_data: Mapping[str, object] | str, **kwargs: Any) -> str:
    with pytest.raises(JobConfigError) as info:
        check_job_data(job_data, **kwargs)
    return str(info.value)


def test_a_misspelt_built_in_type_is_refused_with_a_suggestion() -> None:
    message = refused(
        {"components": [{**TRAINER, "type": "SoftmaxRegresionTrainer"}], "executors": {"*": "@t"}}
    )
    assert "unknown type 'SoftmaxRegresionTrainer' (did you mean 'SoftmaxRegressionTrainer'?)" in message
    assert "pkg.module:Name" in message
    assert "did you mean 'Float16Compression'" in refused(
        {"components": [{"type": "float16compression", "name": "f"}]}
    )
    assert "did you mean 'mypkg.nets:Net'" in refused(
        {"components": [{"type": "mypkg.nets.Net", "name": "n"}]}
    )


def test_a_dangling_reference_is_refused_wherever_it_is() -> None:
    assert "references undefined component '@data'" in refused(
        {"components": [{**TRAINER, "args": {"data_source": "@data"}}], "executors": {"*": "@t"}}
    )
    assert "executors['train'] references undefined component '@trainer' (components: 't')" in refused(
        {"components": [TRAINER], "executors": {"train": "@trainer"}}
    )
    for key in ("in_filters", "out_filters", "handlers"):
        assert f"{key}[0] references undefined component '@dp'" in refused(
            {"components": [TRAINER], "executors": {"*": "@t"}, key: ["@dp"]}
        )


def test_a_task_the_workflow_sends_without_an_executor_is_refused() -> None:
    job_data = {"components": [TRAINER], "executors": {"train": "@t"}}
    message = refused(job_data, task_names=("train", "evaluate"), workflow="the fedavg workflow")
    assert "no executor for task 'evaluate', which the fedavg workflow sends (executors: 'train')" in message
    check_job_data(job_data, task_names=("train",))
    check_job_data({"components": [TRAINER], "executors": {"*": "@t"}}, task_names=("train", "evaluate"))
    check_job_data(
        {"components": [{**TRAINER, "name": "trainer"}]}, task_names=("train",)
    )  # NVFlare's legacy rule
    assert "no executor for task 'train'" in refused({"components": [TRAINER]}, task_names=("train",))
    check_job_data({"components": [TRAINER]}, task_names=None)  # a workflow that does not say


def test_every_problem_is_reported_at_once_and_kinds_and_args_of_built_ins_are_checked() -> None:
    message = refused(
        {
            "components": [
                {**TRAINER, "args": {"epoch": 2}},
                {"type": "NpzDataSource", "name": "d", "args": {"path": "x"}},
            ],
            "executors": {"*": "@d"},
            "out_filters": ["@t", "not a reference"],
        }
    )
    assert message.startswith("job_data has 4 problems: (1) ")
    assert "got an unexpected keyword argument 'epoch'" in message
    assert "executors['*'] = '@d' is a NpzDataSource, not an Executor" in message
    assert "out_filters[0] = '@t' is a SoftmaxRegressionTrainer, not a Filter" in message
    assert "out_filters[1] must be a reference like '@name'" in message


def test_import_paths_are_checked_for_form_only_and_known_types_pass() -> None:
    check_job_data({"components": [{"type": "mypkg.nets:Net", "name": "n"}], "executors": {"*": "@n"}})
    assert "not a built-in type's name nor an import path" in refused(
        {"components": [{"type": "a b:C", "name": "n"}]}
    )
    assert "cannot be private" in refused({"components": [{"type": "mypkg:_C", "name": "n"}]})
    app = {"components": [{"type": "Trainer.DLTrainer", "name": "n"}], "executors": {"*": "@n"}}
    message = refused(app, known_types_hint="or one in component_types")
    assert message.endswith("or one in component_types")
    check_job_data(app, known_types=["Trainer.*"])


def test_structure_problems_are_refused_with_job_data_named() -> None:
    assert refused("[1, 2]") == "job_data must be a JSON object, not list"
    assert "component reference cycle: a -> b -> a" in refused(
        {
            "components": [
                {**TRAINER, "name": "a", "args": {"data_source": "@b"}},
                {**TRAINER, "name": "b", "args": {"data_source": "@a"}},
            ]
        }
    )
    assert "unknown key(s) ['executor']" in refused({"components": [], "executor": {}})


def test_relative_paths_of_built_in_data_sources_resolve_against_the_job_file() -> None:
    document = {
        "components": [
            {"type": "NpzDataSource", "name": "d", "args": {"path": "data/digits.npz"}},
            {"type": "CsvDataSource", "name": "c", "args": {"train": "/abs/train.csv", "test": "test.csv"}},
            {
                "type": "mypkg.nets:Net",
                "name": "n",
                "args": {"path": "mine.npz"},
            },  # an app's args: as written
        ]
    }
    resolved, paths = resolve_paths(document, Path("/jobs/digits"))
    args = [c["args"] for c in resolved["components"]]
    assert args[0] == {"path": "/jobs/digits/data/digits.npz"}
    assert args[1] == {
        "train": "/abs/train.csv",
        "test": "/jobs/digits/test.csv",
    }  # absolute: a device's path
    assert args[2] == {"path": "mine.npz"}
    assert paths == [
        ("components[0] ('d') args.path", Path("/jobs/digits/data/digits.npz")),
        ("components[1] ('c') args.test", Path("/jobs/digits/test.csv")),
    ]
    assert document["components"][0]["args"] == {"path": "data/digits.npz"}
