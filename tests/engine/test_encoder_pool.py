"""Encoder workers: tiny-llava's images encoded in separate processes (vision.encoder_processes)
give the same greedy output as in the engine process, jobs spread over the encoders, and an
image an encoder cannot read or an encoder that never answers ends the request with an error
(by vision.encode_timeout_s), never a hang; pools back to start."""

from __future__ import annotations

import os
import time

import pytest
import zmq
from vlm_images import image_chat

from pdserve import SamplingParams
from pdserve.common.images import ImageInput
from pdserve.engine.encoder_pool import pick_encoder
from pdserve.engine.llm import LLM
from pdserve.model.loader import load_model_files

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model_files("tiny-llava")


def test_pick_encoder_least_loaded_then_round_robin():
    assert pick_encoder([3, 1, 2], last=0) == 1
    assert pick_encoder([0, 0, 0], last=0) == 1
    assert pick_encoder([0, 0, 0], last=2) == 0
    assert pick_encoder([1, 0, 0], last=1) == 2


def _run(llm, rid_prompts):
    eng = llm.engine
    for rid, (ids, images) in rid_prompts.items():
        eng.add_request(rid, ids, GREEDY, images=images)
    outs: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    deadline = time.monotonic() + 120
    while eng.has_unfinished():
        assert time.monotonic() < deadline, eng.stats()
        for out in eng.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.error:
                errors[out.request_id] = out.error
    return outs, errors


@pytest.mark.slow  # two spawned processes load the model
def test_encoder_processes_equal_in_process(loaded):
    local = LLM(model="tiny-llava", loaded=loaded, block_size=4, device_blocks=256)
    convs = [image_chat(1), image_chat(2, 3), image_chat(4)]
    want = [o.token_ids for o in local.chat(convs, GREEDY)]
    pooled = LLM(
        model="tiny-llava", loaded=loaded, block_size=4, device_blocks=256, vision__encoder_processes=2
    )
    try:
        prompts = {f"r{i}": pooled._chat_prompt(c) for i, c in enumerate(convs)}
        got, errors = _run(pooled, prompts)
        assert not errors and [got[f"r{i}"] for i in range(3)] == want
        pool = pooled.engine.images.pool
        assert pool.jobs_total == 3 and len({ep for ep in pool.endpoints}) == 2
        assert pool.outstanding == [0, 0] and not pool.jobs
        # A file the encoder cannot decode (the API would have refused it): the request ends with an error.
        ids, images = prompts["r0"]
        bad = [ImageInput(im.offset, im.length, b"x" * 16, b"not an image") for im in images]
        _, errors = _run(pooled, {"bad": (ids, bad)})
        assert "not a decodable image" in errors["bad"]
        assert pooled.engine.pool.num_free == pooled.engine.pool.num_blocks
    finally:
        pooled.engine.close()
    assert all(not p.is_alive() for p in pool.processes)
    # Their sockets' files go with them (SIGTERM ends an encoder at once).
    assert all(ep.startswith("ipc://") for ep in pool.endpoints)
    assert not [ep for ep in pool.endpoints if os.path.exists(ep[len("ipc://") :])]


def test_an_encoder_that_never_answers_fails_the_request_by_its_deadline(loaded):
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        llm = LLM(
            model="tiny-llava",
            loaded=loaded,
            block_size=4,
            device_blocks=256,
            vision__encoder_endpoints=[f"tcp://127.0.0.1:{port}"],
            vision__encode_timeout_s=0.5,
        )
        _, errors = _run(llm, {"r": llm._chat_prompt(image_chat(1))})
        assert "within 0.5 s" in errors["r"]
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks and not llm.engine.images.pending
    finally:
        sock.close(0)


@pytest.mark.slow  # a `pdserve encoder` process loads the model
def test_a_pdserve_encoder_process_serves_remote_engines(loaded, tmp_path):
    import subprocess

    from pdserve.bench.procs import free_port, pdserve_cmd

    port = free_port()
    log = open(tmp_path / "encoder.log", "w")
    proc = subprocess.Popen(
        pdserve_cmd()
        + ["encoder", "--model", "tiny-llava", "--bind", f"tcp://127.0.0.1:{port}", "--threads", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        want = LLM(model="tiny-llava", loaded=loaded, block_size=4, device_blocks=256).chat(
            image_chat(8), GREEDY
        )[0]
        remote = LLM(
            model="tiny-llava",
            loaded=loaded,
            block_size=4,
            device_blocks=256,
            vision__encoder_endpoints=[f"tcp://127.0.0.1:{port}"],
        )
        got, errors = _run(remote, {"r": remote._chat_prompt(image_chat(8))})
        assert not errors and got["r"] == want.token_ids
        assert remote.engine.images.pool.jobs_total == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_with_an_internal_token_encoders_answer_only_signed_jobs():
    from vlm_images import image_bytes

    from pdserve.config import load_config
    from pdserve.engine.encoder_worker import EncoderWorker, encoder_key
    from pdserve.utils.signing import sign, verified

    config = load_config(None, {"model.name": "tiny-llava", "server.internal_token": "s3cret"})
    worker, key = EncoderWorker(config), encoder_key(config)
    job = {"type": "encode", "job": "j1", "images": [image_bytes(1)]}
    assert worker.answer(job) is None  # never answered, never encoded
    assert worker.answer(sign(job, encoder_key(load_config(None, {"server.internal_token": "x"})))) is None
    assert worker.jobs_total == 0 and worker.rejected_total == 2
    ok = worker.answer(sign(job, key))
    assert ok["error"] is None and ok["shape"] == [16, 64] and len(ok["embeds"]) == 1
    assert verified(sign(ok, key), key) and not verified(ok | {"auth": "0" * 64}, key)


class _FakeEncoder:
    """An encoder endpoint played by hand: answers each job with what `answer(job)` returns."""

    def __init__(self, answer) -> None:
        import threading

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.answer, self.stop = answer, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from pdserve.protocol import pack, unpack

        while not self.stop.is_set():
            if self.sock.poll(50):
                ident, body = self.sock.recv_multipart()
                job = unpack(body)
                self.sock.send_multipart([ident, pack(self.answer(job))])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)


@pytest.mark.parametrize("bad", ["shape", "size", "nan", "types"])
def test_an_encoder_answer_of_the_wrong_shape_or_values_fails_the_request_not_the_engine(loaded, bad):
    import numpy as np

    tokens, hidden = loaded.vision.spec.tokens_per_image, loaded.vision.spec.text_hidden_size
    mode = {"bad": bad}

    def answer(job):
        n, bad = len(job["images"]), mode["bad"]
        rows = np.zeros((tokens, hidden), np.float32)
        if bad == "nan":
            rows[0, 0] = np.nan
        shape = {"shape": [tokens * 2, hidden // 2]}.get(bad, [tokens, hidden])
        embeds = [rows.tobytes()[:-4] if bad == "size" else rows.tobytes()] * n
        if bad == "types":
            shape, embeds = ["x", None], [1] * n
        return {
            "type": "embeds",
            "job": job["job"],
            "shape": shape,
            "dtype": "float32",
            "error": None,
            "embeds": embeds,
        }

    enc = _FakeEncoder(answer)
    try:
        llm = LLM(
            model="tiny-llava",
            loaded=loaded,
            block_size=4,
            device_blocks=256,
            vision__encoder_endpoints=[enc.endpoint],
        )
        _, errors = _run(llm, {"r": llm._chat_prompt(image_chat(1))})
        assert "the encoder answered" in errors["r"], errors
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks and not llm.engine.images.pending
        # The engine lives on: the same encoder's sound answer serves the next request.
        mode["bad"] = "none"
        got, errors = _run(llm, {"r2": llm._chat_prompt(image_chat(1))})
        assert not errors and len(got["r2"]) == GREEDY.max_tokens
    finally:
        enc.close()


def test_an_encoder_takes_no_frame_larger_than_its_images_can_be(tmp_path):
    import threading

    from vlm_images import image_bytes

    from pdserve.config import load_config
    from pdserve.engine.encoder_worker import EncoderWorker
    from pdserve.protocol import pack, unpack

    config = load_config(
        None, {"model.name": "tiny-llava", "vision.max_images": 1, "vision.max_image_bytes": 4096}
    )
    worker, stop = EncoderWorker(config), threading.Event()
    # A socket file of its own, as the pool gives its encoders: a port found free and handed to the
    # worker could be taken again before it binds.
    endpoint = f"ipc://{tmp_path}/encoder"
    t = threading.Thread(target=worker.serve, args=(endpoint, stop.is_set), daemon=True)
    t.start()
    try:
        limit = 4096 + (1 << 20)  # one image of max_image_bytes and the control headroom
        for job, images in (("big", [b"\0" * (limit + 10)]), ("ok", [image_bytes(1)])):
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            dealer.send(pack({"type": "encode", "job": job, "images": images}))
            # Dropped with its connection before anything reads it; the sound job is answered.
            answered = dealer.poll(3000 if job == "big" else 60000)
            if job == "big":
                assert not answered
            else:
                assert answered and unpack(dealer.recv())["error"] is None
            dealer.close(0)
        assert worker.jobs_total == 1
    finally:
        stop.set()
        t.join(5)
