"""The CLI without a server: argument errors, and a dead address reported rather than raised."""

import json

import pytest

from pdserve.bench.cli import main
from pdserve.bench.procs import free_port as closed_port  # bound then closed: nobody listens


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-requests", "0"],
        ["--concurrency", "0"],
        ["--request-rate", "-1"],
        ["--concurrency", "2", "--request-rate", "1"],
        ["--workload", "nope"],
        ["--sweep-concurrency", "1,x"],
        ["--workload", __file__],  # a file, but not JSONL
    ],
)
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_unreachable_server_counts_errors(tmp_path):
    out = tmp_path / "r.json"
    rc = main(
        [
            "--base-url",
            f"http://127.0.0.1:{closed_port()}",
            "--workload",
            "multiturn",
            "-n",
            "5",
            "-c",
            "2",
            "--output-json",
            str(out),
            "--no-progress",
            "--save-requests",
        ]
    )
    assert rc == 1  # nothing completed
    r = json.loads(out.read_text())
    assert r["completed"] == 0 and r["failed"] == 5
    assert r["errors"] == {"connect_error": 5}
    assert len(r["requests"]) == 5
    assert r["config"]["workload"] == "multiturn" and "api_key" not in r["config"]


def test_unreachable_server_with_model_given(tmp_path):
    # With --model there is no /v1/models probe: each request fails on its own, and the later
    # turns of a conversation are counted as aborted.
    out = tmp_path / "r.json"
    main(
        [
            "--base-url",
            f"http://127.0.0.1:{closed_port()}/v1",
            "--model",
            "m",
            "--workload",
            "multiturn",
            "-n",
            "6",
            "-r",
            "50",
            "--seed",
            "3",
            "--output-json",
            str(out),
            "--no-progress",
        ]
    )
    r = json.loads(out.read_text())
    assert r["failed"] == 6 and r["completed"] == 0
    assert set(r["errors"]) == {"connect_error", "conversation_aborted"}
    assert r["errors"]["connect_error"] >= 1
