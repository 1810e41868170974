"""The extension tables: one per extension point, and every list of names, check and builder derived from it.

`ARCHITECTURES` (omni_core.models.architectures), `WIRE_FORMATS` (omni_core.rewards.wire_format) and the SDE defaults
(omni_core.sde_defaults). Where a name list must be spelled out (a `Literal` gives the Prefect form and the config's
JSON schema their choices), these tests check it equals the table.
"""

from __future__ import annotations

import inspect
import json
import pickle
import re
import typing

import pytest
import torch

from omni_core.config import OmniFlowConfig
from omni_core.config.defaults_file import load_defaults
from omni_core.config.schema import RewardFunctionSpec, SdeAlgoConfig
from omni_core.config.unsupported import UNSUPPORTED_KEYS
from omni_core.models import tiny
from omni_core.models.arch import ArchAdapter, adapter_for
from omni_core.models.architectures import ARCHITECTURES, BY_PIPELINE, architecture_choices, find_architecture
from omni_core.models.loader import ModelLoadError, load_pipeline, resolve_architecture
from omni_core.models.model_index import pipeline_class_name
from omni_core.rewards.server_client import RewardServerClient, server_term
from omni_core.rewards.terms import RewardBatch
from omni_core.rewards.wire_format import JSON_FORMAT, PICKLE_FORMAT, WIRE_FORMATS, json_request, pickle_request
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.sde import SDE_TYPES, sde_step_with_logprob
from omni_core.sde_defaults import NOISE_LEVEL, SDE_TYPE


# ----------------------------------------------------------------------------------------- architectures
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_named_part_of_an_architecture_exists_and_agrees(name):
    entry = ARCHITECTURES[name]
    pipeline_cls = entry.pipeline_cls()
    assert pipeline_cls.__name__ == entry.pipeline
    assert issubclass(entry.adapter_cls(), ArchAdapter)
    assert entry.published_model().pipeline_cls is pipeline_cls
    builder = getattr(tiny, entry.tiny_builder)
    assert inspect.signature(builder).return_annotation == entry.pipeline  # a string under `from __future__`
    assert entry.cfg_scale in ("guidance_scale", "true_cfg_scale")
    if entry.cfg_scale == "true_cfg_scale":  # the guidance rule quotes why guidance_scale may have nothing to feed
        assert entry.none_reason


def test_names_resolve_through_the_table():
    for entry in ARCHITECTURES.values():
        assert find_architecture(entry.name.upper()) is entry and find_architecture(entry.pipeline) is entry
        assert resolve_architecture(entry.name) == entry.pipeline
    assert find_architecture("sdxl") is None
    assert architecture_choices() == sorted(BY_PIPELINE) + sorted(ARCHITECTURES)
    with pytest.raises(ModelLoadError) as err:
        resolve_architecture("sdxl")
    for choice in architecture_choices():
        assert repr(choice) in str(err.value)


def test_model_index_reads_the_architecture_from_the_table(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert pipeline_class_name(tmp_path, "qwen-image") == "QwenImagePipeline"
    assert pipeline_class_name(tmp_path, "auto") == "FluxPipeline"
    assert pipeline_class_name(tmp_path, "SomethingElse") == "SomethingElse"  # left to check_pipeline_folder


def test_adapters_take_cfg_from_the_table(tiny_sd3_dir):
    pipe = load_pipeline(tiny_sd3_dir)
    adapter = adapter_for(pipe)
    assert adapter.architecture is ARCHITECTURES["sd3"] and type(adapter) is ARCHITECTURES["sd3"].adapter_cls()
    assert adapter.cfg_scale(guidance_scale=4.5, true_cfg_scale=1.0) == 4.5
    for name, entry in ARCHITECTURES.items():  # the same rule, without building the other pipelines
        stand_in = object.__new__(entry.pipeline_cls())
        expected = 2.0 if entry.cfg_scale == "guidance_scale" else 3.0
        assert entry.adapter_cls()(stand_in).cfg_scale(2.0, 3.0) == expected, name


def test_tiny_builder_refuses_an_unknown_architecture_with_the_table_names(tmp_path):
    with pytest.raises(ValueError, match=r"arch='sdxl'.*" + re.escape(str(list(ARCHITECTURES)))):
        tiny.build_tiny_pipeline(tmp_path, arch="sdxl")


def test_spelled_out_architecture_names_equal_the_table(capsys):
    from omniflow.flows.cli import build_parser
    from omniflow.flows.pipeline import ArchName, diffusion_rl_pipeline
    from omniflow.flows.pipeline import main as pipeline_main

    assert typing.get_args(ArchName) == tuple(ARCHITECTURES)
    arch_doc = inspect.getdoc(diffusion_rl_pipeline.fn).split("arch:")[1].split("config:")[0]
    for entry in ARCHITECTURES.values():
        assert f"`{entry.name}`: {entry.pipeline}" in " ".join(arch_doc.split())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["make-tiny-model", "out", "--arch", "nope"])
    assert f"choose from {', '.join(repr(c) for c in [*ARCHITECTURES, 'clip'])}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pipeline_main(["--arch", "nope"])
    assert f"choose from {', '.join(repr(c) for c in ARCHITECTURES)}" in capsys.readouterr().err
    # the verl-omni key OmniFlow refuses names every supported pipeline (config cannot import the models layer)
    for entry in ARCHITECTURES.values():
        assert entry.pipeline in UNSUPPORTED_KEYS["actor_rollout_ref.model.external_lib"]


# ----------------------------------------------------------------------------------------- wire formats
def _images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (3, 8, 8), generator=g, dtype=torch.uint8) for _ in range(2)]


def test_wire_format_names_equal_the_config_choices():
    assert typing.get_args(RewardFunctionSpec.model_fields["format"].annotation) == tuple(WIRE_FORMATS)
    assert RewardFunctionSpec.model_fields["format"].default in WIRE_FORMATS


def test_wire_formats_encode_the_bytes_of_the_format_functions():
    images, prompts = _images(), ["a cat", None]
    metadata = [{"data_source": "x", "ground_truth": None, "extra_info": {}}] * 2
    assert JSON_FORMAT.encode(images, prompts, metadata) == json_request(images, prompts, metadata)
    assert PICKLE_FORMAT.encode(images, prompts, metadata) == pickle_request(images, ["a cat", ""])
    assert (JSON_FORMAT.content_type, PICKLE_FORMAT.content_type) == ("application/json", "application/octet-stream")
    assert JSON_FORMAT.parse(json.dumps({"scores": [1.0, 2.0]}).encode(), 2) == [1.0, 2.0]
    assert PICKLE_FORMAT.parse(pickle.dumps({"scores": [1.0, 2.0]}), 2) == [1.0, 2.0]


def test_wire_format_error_detail_reads_its_own_encoding():
    assert JSON_FORMAT.error_detail(b'{"error": "bad prompt"}') == "bad prompt"
    assert PICKLE_FORMAT.error_detail(pickle.dumps({"error": "bad prompt"})) == "bad prompt"
    # the other format's body is not an error object: its text (pickle's, decoded with replacements) is the reason
    assert JSON_FORMAT.error_detail(b"upstream timeout\n") == "upstream timeout"
    assert PICKLE_FORMAT.error_detail(b'{"error": "x"}') == '{"error": "x"}'
    assert PICKLE_FORMAT.error_detail(b"") == "(empty body)"


@pytest.mark.parametrize("fmt", sorted(WIRE_FORMATS))
def test_the_client_speaks_the_table_entry(fmt):
    import httpx

    wire = WIRE_FORMATS[fmt]
    answer = json.dumps({"scores": [0.5, 0.25]}).encode() if wire is JSON_FORMAT else pickle.dumps({"scores": [0.5, 0.25]})
    client = RewardServerClient("http://127.0.0.1:9/score", {}, fmt=fmt)
    requests = []
    client._client = httpx.Client(
        transport=httpx.MockTransport(lambda r: requests.append(r) or httpx.Response(200, content=answer))
    )
    batch = RewardBatch(
        images=_images(), prompts=["a", "b"], data_sources=["s", "s"], ground_truths=[None, None], extra_infos=[{}, {}]
    )
    assert client(batch) == [0.5, 0.25]
    (request,) = requests
    assert request.headers["content-type"] == wire.content_type
    metadata = [{"data_source": "s", "ground_truth": None, "extra_info": {}}] * 2
    assert request.content == wire.encode(batch.images, ["a", "b"], metadata)


def test_the_client_refuses_an_unknown_format_and_verl_entries_speak_pickle():
    with pytest.raises(ValueError, match=r"format='xml'.*" + re.escape(str(list(WIRE_FORMATS)))):
        RewardServerClient("http://127.0.0.1:9/score", {}, fmt="xml")
    spec = RewardFunctionSpec(server_url="http://127.0.0.1:9/score")
    assert server_term(spec, verl_client=True).fn.wire is PICKLE_FORMAT
    assert server_term(spec).fn.wire is WIRE_FORMATS[spec.format]


# ----------------------------------------------------------------------------------------- SDE defaults
def test_sde_defaults_equal_the_config_defaults():
    algo = load_defaults()[0]["actor_rollout_ref"]["rollout"]["algo"]
    assert (algo["noise_level"], algo["sde_type"]) == (NOISE_LEVEL, SDE_TYPE)
    config_algo = OmniFlowConfig().actor_rollout_ref.rollout.algo
    assert (config_algo.noise_level, config_algo.sde_type) == (NOISE_LEVEL, SDE_TYPE)
    assert typing.get_args(SdeAlgoConfig.model_fields["sde_type"].annotation) == SDE_TYPES and SDE_TYPE in SDE_TYPES


def test_every_signature_defaults_to_the_shared_sde_constants():
    from omni_core.rollout.sampler import generate, score_transitions
    from omni_core.sde import sde_step_from_sigmas

    params = SamplingParams(n=1, seed=0, height=8, width=8, num_inference_steps=2)
    assert (params.noise_level, params.sde_type) == (NOISE_LEVEL, SDE_TYPE)
    for fn in (generate, sde_step_with_logprob):
        signature = inspect.signature(fn).parameters
        assert (signature["noise_level"].default, signature["sde_type"].default) == (NOISE_LEVEL, SDE_TYPE)
    for fn in (score_transitions, sde_step_from_sigmas):
        assert inspect.signature(fn).parameters["sde_type"].default == SDE_TYPE
