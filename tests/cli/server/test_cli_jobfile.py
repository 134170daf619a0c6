"""Malformed job files: each is a clear error naming the file or key, exit 2, and nothing is submitted."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.errors import InvalidArgument
from fedlink.server.cli.jobfile import load_job_file
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.server.workflows.wire import ROUND_DEFAULTS, spec_from_wire
from fedlink.v1 import control_service_pb2 as cpb

from .conftest import Cli, CoordinatorThread, cli_for, plaintext_settings

GOOD_TOML = """
name = "digits"
model = "initial.npz"
[fedavg]
num_rounds = 3
devices_per_round = 2
min_results = 2
round_timeout = "1m30s"
evaluate = true
round_failure_policy = "fail"
keep_checkpoints = 1
[job_data]
components = [{ type = "SoftmaxRegressionTrainer", name = "trainer" }]
executors = { "*" = "@trainer" }
"""


@pytest.fixture(scope="module")
def shared_cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    """One coordinator for every refused file: none of them may leave a job behind."""
    with CoordinatorThread(plaintext_settings(tmp_path_factory.mktemp("coordinator"))) as running:
        yield cli_for(running)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    np.savez(tmp_path / "initial.npz", w=np.ones((2, 2), np.float32), step=np.array([3], np.int64))
    return tmp_path


def test_a_good_toml_file_maps_to_the_job_spec(folder: Path) -> None:
    path = folder / "job.toml"
    path.write_text(GOOD_TOML)
    job = load_job_file(path)
    spec = job.spec("ab" * 32, 123)
    assert spec.name == "digits"
    assert spec.fedavg.num_rounds == 3
    assert spec.fedavg.devices_per_round == 2
    assert spec.fedavg.round_timeout.ToTimedelta().total_seconds() == 90
    assert spec.fedavg.evaluate is True
    assert spec.fedavg.round_failure_policy == cpb.ROUND_FAILURE_POLICY_FAIL
    assert spec.fedavg.keep_checkpoints == 1
    assert json.loads(spec.job_data) == {
        "components": [{"type": "SoftmaxRegressionTrainer", "name": "trainer"}],
        "executors": {"*": "@trainer"},
    }
    assert (spec.initial_model.sha256, spec.initial_model.size_bytes) == ("ab" * 32, 123)
    model = DXO.from_bytes(job.model_bytes)
    assert model.kind is DataKind.WEIGHTS
    np.testing.assert_array_equal(model.data["w"], np.ones((2, 2), np.float32))
    assert model.data["step"].dtype == np.int64


def test_a_round_key_left_out_means_the_workflow_s_default_on_the_wire(folder: Path) -> None:
    # On the wire 0 is a value: a job file without max_round_retries must not mean "never retry".
    path = folder / "job.toml"
    path.write_text(GOOD_TOML)
    spec = load_job_file(path).spec("ab" * 32, 123)
    assert spec.fedavg.max_round_retries == FedAvgParams(num_rounds=1).max_round_retries == 2
    assert spec_from_wire(spec).config["max_round_retries"] == 2
    for name, default in ROUND_DEFAULTS.items():
        assert getattr(FedAvgParams(num_rounds=1), name) == default, name
    path.write_text(GOOD_TOML.replace("keep_checkpoints = 1", "keep_checkpoints = 1\nmax_round_retries = 0"))
    assert load_job_file(path).spec("ab" * 32, 123).fedavg.max_round_retries == 0


def test_a_json_file_with_an_absolute_model_path_works(folder: Path, tmp_path: Path) -> None:
    path = tmp_path / "elsewhere" / "job.json"
    path.parent.mkdir()
    document = {
        "name": "j",
        "model": str(folder / "initial.npz"),
        "fedavg": {"num_rounds": 1, "fraction": 0.5},
    }
    path.write_text(json.dumps(document))
    job = load_job_file(path)
    assert job.workflow.name == "fedavg"
    assert job.workflow.config == {"num_rounds": 1, "fraction": 0.5}  # the rest: the coordinator's
    assert not job.spec("ab" * 32, 1).fedavg.HasField("round_timeout")
    assert job.job_data == "{}"


BAD_FILES: list[tuple[str, str, str]] = [
    ("job.toml", 'name = "x"\nmodel = [', "not valid TOML"),
    ("job.json", '{"name": "x",', "not valid JSON"),
    ("job.json", "[1, 2]", "must be a JSON object"),
    ("job.yaml", "name: x", ".toml or .json"),
    ("job.toml", 'owner = "me"\n' + GOOD_TOML, "unknown key(s) owner"),
    ("job.toml", GOOD_TOML.replace('name = "digits"', ""), "name is missing"),
    ("job.toml", GOOD_TOML.replace('name = "digits"', "name = 5"), "name must be a string of 1 to 128"),
    (
        "job.toml",
        GOOD_TOML.replace('name = "digits"', f'name = "{"n" * 129}"'),
        "name must be a string of 1 to",
    ),
    ("job.toml", GOOD_TOML.replace("evaluate = true", "rounds = 3"), "unknown key(s) in fedavg: rounds"),
    (
        "job.toml",
        GOOD_TOML.replace("num_rounds = 3", 'num_rounds = "3"'),
        "fedavg.num_rounds must be a whole",
    ),
    (
        "job.toml",
        GOOD_TOML.replace("num_rounds = 3", "num_rounds = 0"),
        "fedavg.num_rounds must be at least 1",
    ),
    ("job.toml", GOOD_TOML.replace("num_rounds = 3", ""), "fedavg.num_rounds is missing"),
    (
        "job.toml",
        GOOD_TOML.replace("evaluate = true", "evaluate = 1"),
        "fedavg.evaluate must be true or false",
    ),
    ("job.toml", GOOD_TOML.replace('"1m30s"', '"soon"'), "fedavg.round_timeout: not a duration"),
    (
        "job.toml",
        GOOD_TOML.replace('"fail"', '"ignore"'),
        "round_failure_policy must be one of 'retry', 'fail'",
    ),
    ("job.toml", GOOD_TOML.replace("min_results = 2", "min_results = 5"), "min_results cannot exceed"),
    ("job.toml", GOOD_TOML.replace("[fedavg]", "[fedavg]\nfraction = 0.5"), "fraction or devices_per_round"),
    (
        "job.toml",
        GOOD_TOML.replace('model = "initial.npz"', 'model = "missing.npz"'),
        "missing.npz does not exist",
    ),
    ("job.toml", GOOD_TOML.replace('model = "initial.npz"', 'model = "model.pt"'), ".npz or .safetensors"),
    (
        "job.toml",
        GOOD_TOML.replace('model = "initial.npz"', 'model = "bools.npz"'),
        "array 'mask' has dtype bool",
    ),
    ("job.toml", GOOD_TOML.replace('model = "initial.npz"', 'model = "objects.npz"'), "not a readable .npz"),
    ("job.toml", GOOD_TOML.replace('model = "initial.npz"', 'model = "empty.npz"'), "holds no arrays"),
    ("job.toml", GOOD_TOML.replace('model = "initial.npz"', 'model = "broken.npz"'), "not a readable .npz"),
    ("job.toml", GOOD_TOML.replace('model = "initial.npz"', 'model = "single.npz"'), "one unnamed array"),
    (
        "job.toml",
        GOOD_TOML.replace("[job_data]", "[job_data]\nwhen = 1979-05-27"),
        "job_data cannot be sent as JSON",
    ),
    (
        "job.toml",
        GOOD_TOML.replace('model = "initial.npz"', 'model = "initial.npz"\ndevice_selector = { cores = 4 }'),
        "device_selector.cores must be a string",
    ),
    # job_data as the coordinator would refuse it, refused before the model is uploaded
    (
        "job.toml",
        GOOD_TOML.replace('"*" = "@trainer"', '"*" = "@trainr"'),
        "executors['*'] references undefined component '@trainr' (components: 'trainer')",
    ),
    (
        "job.toml",
        GOOD_TOML.replace('"*" = "@trainer"', '"train" = "@trainer"'),
        "no executor for task 'evaluate', which the fedavg workflow sends (executors: 'train')",
    ),
    (
        "job.toml",
        GOOD_TOML.replace('name = "trainer" }', 'name = "trainer", args = { epoch = 2 } }'),
        "got an unexpected keyword argument 'epoch'",
    ),
    (
        "job.toml",
        GOOD_TOML.replace(
            "components = [",
            'components = [{ type = "NpzDataSource", name = "d", args = { path = "data/none.npz" } }, ',
        ),
        "args.path: file ",  # ... <folder>/data/none.npz does not exist
    ),
    ("job.toml", GOOD_TOML + "[simulation]\ndevcies = 3\n", "unknown key(s) in simulation: devcies"),
    (
        "job.toml",
        GOOD_TOML + '[simulation]\npartition = "skewed"\n',
        "simulation.partition must be iid or dirichlet",
    ),
    ("job.toml", GOOD_TOML + "[simulation]\ndevices = 0\n", "simulation.devices must be an integer >= 1"),
    (
        "job.toml",
        GOOD_TOML + "[simulation]\npartition_alpha = -1.0\n",
        "partition_alpha must be a number > 0",
    ),
]


def _write_models(folder: Path) -> None:
    np.savez(folder / "bools.npz", mask=np.array([True, False]))
    np.savez(folder / "objects.npz", o=np.array([{"a": 1}], dtype=object))
    np.savez(folder / "empty.npz")
    (folder / "broken.npz").write_bytes(b"PK\x03\x04 not really a zip")
    (folder / "model.pt").write_bytes(b"\x80\x02")
    with (folder / "single.npz").open("wb") as file:
        np.save(file, np.zeros(3))


@pytest.mark.parametrize(("name", "text", "message"), BAD_FILES, ids=[c[2] for c in BAD_FILES])
def test_a_malformed_job_file_is_refused_and_nothing_is_submitted(
    shared_cli: Cli, folder: Path, name: str, text: str, message: str
) -> None:
    _write_models(folder)
    path = folder / name
    path.write_text(text)
    with pytest.raises(InvalidArgument) as caught:
        load_job_file(path)
    assert message in caught.value.message
    assert str(folder) in caught.value.message  # it names the file

    result = shared_cli("job", "submit", str(path))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ")
    assert message in result.stderr
    assert "Traceback" not in result.output
    listed = shared_cli("job", "list", "--format", "json")
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout) == []


def test_a_missing_job_file_is_refused(shared_cli: Cli, tmp_path: Path) -> None:
    result = shared_cli("job", "submit", str(tmp_path / "nope.toml"))
    assert result.exit_code == 2
    assert "nope.toml does not exist" in result.stderr


def test_safetensors_without_the_package_is_a_clear_error(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The package is optional: whether or not this environment has it, hide it (None in sys.modules
    # makes the import fail) to see what a user without it gets.
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    (folder / "m.safetensors").write_bytes(b"{}")
    path = folder / "job.toml"
    path.write_text(GOOD_TOML.replace("initial.npz", "m.safetensors"))
    with pytest.raises(InvalidArgument, match=r"needs the safetensors package \(pip install safetensors\)"):
        load_job_file(path)


def test_a_misspelt_type_is_refused_by_the_coordinator_and_the_cli_says_why(
    shared_cli: Cli, folder: Path
) -> None:
    # The names are the coordinator's to check (it knows which types its devices register): SubmitJob
    # answers INVALID_ARGUMENT, and the CLI prints the coordinator's message.
    path = folder / "job.toml"
    path.write_text(GOOD_TOML.replace('"SoftmaxRegressionTrainer"', '"SoftmaxRegresionTrainer"'))
    result = shared_cli("job", "submit", str(path))
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: INVALID_ARGUMENT: job_data: component 'trainer' has unknown type")
    assert "(did you mean 'SoftmaxRegressionTrainer'?)" in result.stderr
    assert "component_types" in result.stderr
    listed = shared_cli("job", "list", "--format", "json")
    assert json.loads(listed.stdout) == []


def test_relative_paths_in_job_data_are_the_job_file_s_wherever_it_is_used(
    folder: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    (folder / "data").mkdir()
    np.savez(folder / "data" / "digits.npz", x_train=np.zeros((4, 2)), y_train=np.zeros(4))
    path = folder / "job.toml"
    path.write_text(
        GOOD_TOML.replace(
            "components = [",
            'components = [{ type = "NpzDataSource", name = "d", args = { path = "data/digits.npz" } }, '
            '{ type = "CsvDataSource", name = "c", args = { train = "/on/the/device.csv" } }, ',
        )
        + '[simulation]\ndevices = 3\ndata = "data/digits.npz"\npartition = "dirichlet"\n'
    )
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    job = load_job_file(path)
    components = {c["name"]: c for c in json.loads(job.job_data)["components"]}
    assert components["d"]["args"] == {"path": str(folder / "data" / "digits.npz")}
    assert components["c"]["args"] == {"train": "/on/the/device.csv"}  # a device's path: not checked here
    assert job.simulation.devices == 3
    assert job.simulation.data == folder / "data" / "digits.npz"
    assert job.simulation.partition == "dirichlet"
    device_data = job.simulation.device_data()
    assert device_data is not None and device_data.partition == "dirichlet"
    with pytest.raises(InvalidArgument, match=r"--data: data file .*nothing\.npz does not exist"):
        job.simulation.device_data(Path("nothing.npz"))
    # A job file named relatively: the devices still get an absolute path.
    monkeypatch.chdir(folder.parent)
    relative = load_job_file(Path(folder.name) / "job.toml")
    [npz] = [c for c in json.loads(relative.job_data)["components"] if c["name"] == "d"]
    assert npz["args"]["path"] == str((folder / "data" / "digits.npz").resolve())
