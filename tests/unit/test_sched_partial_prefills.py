"""vLLM's `max_num_partial_prefills` / `max_long_partial_prefills`: accepted at 1 (their default), which caps
nothing (as vLLM's V1 scheduler, which never reads them); other values refused naming the field, as vLLM's V1
engine refuses them ("Concurrent Partial Prefill is not supported")."""

from __future__ import annotations

import pytest

from asyncllm import cli_serve
from asyncllm.cli import _parser, main
from asyncllm.cli_args import engine_kwargs
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from test_scheduler import make_request, make_scheduler, run_step


def test_the_defaults_are_vllms_and_travel_with_the_config() -> None:
    config = EngineConfig.create("m")
    assert (config.max_num_partial_prefills, config.max_long_partial_prefills) == (1, 1)
    flat = config.to_dict(wire=True)
    assert (flat["max_num_partial_prefills"], flat["max_long_partial_prefills"]) == (1, 1)
    assert EngineConfig.from_dict(flat).scheduler_config == config.scheduler_config


@pytest.mark.parametrize("fields, field, error, words", [
    ({"max_num_partial_prefills": 2}, "max_num_partial_prefills", NotBuiltError, "concurrent partial prefills"),
    ({"max_num_partial_prefills": 4, "max_long_partial_prefills": 2}, "max_num_partial_prefills", NotBuiltError,
     "Concurrent Partial Prefill is not supported"),
    ({"max_long_partial_prefills": 2}, "max_long_partial_prefills", ConfigError, "at most max_num_partial_prefills (1)"),
    ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, "max_long_partial_prefills", ConfigError,
     "at most max_num_partial_prefills (2)"),
    ({"max_num_partial_prefills": 0}, "max_num_partial_prefills", ConfigError, "an int >= 1"),
    ({"max_long_partial_prefills": True}, "max_long_partial_prefills", ConfigError, "an int >= 1"),
    ({"max_num_partial_prefills": None}, "max_num_partial_prefills", ConfigError, "an int >= 1"),
])
def test_values_other_than_one_are_refused_naming_the_field(fields, field, error, words) -> None:
    with pytest.raises(error) as info:
        EngineConfig.create("m", **fields)
    assert type(info.value) is error and info.value.field == field and words in str(info.value)


def test_one_caps_nothing_several_requests_are_mid_prefill_in_one_step() -> None:
    """As vLLM's V1 scheduler: two prompts each get a threshold-capped chunk in the same step, so two requests are
    partially prefilled at once with max_num_partial_prefills=1 (the field has no consumer there)."""
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8, max_num_partial_prefills=1,
                           max_long_partial_prefills=1)
    for req_id in ("a", "b", "c"):
        sched.add_request(make_request(req_id, 20))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 8, "b": 8, "c": 8}
    assert run_step(sched)[0].num_scheduled_tokens == {"a": 8, "b": 8, "c": 8}


@pytest.mark.parametrize("command", ["generate", "serve", "engine"])
def test_the_commands_take_the_flags(command) -> None:
    argv = [command] + (["--model", "m"] if command == "generate" else ["m"])
    args = _parser().parse_args(argv + ["--max-num-partial-prefills", "1", "--max-long-partial-prefills", "1"])
    assert {key: value for key, value in engine_kwargs(args).items() if "partial" in key} == {
        "max_num_partial_prefills": 1, "max_long_partial_prefills": 1}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_flag_other_than_one_is_one_error_line_before_anything_starts(command, capsys, monkeypatch) -> None:
    def no_server(*args: object) -> None:
        raise AssertionError("the server started")

    monkeypatch.setattr(cli_serve, "serve_app", no_server)
    argv = [command] + (["--model", "m"] if command == "generate" else ["m"])
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--max-num-partial-prefills", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error: max_num_partial_prefills=2 is not allowed" in err
    assert "Traceback" not in err
