"""One decoded token of one sequence on a CUDA device, replayed as a CUDA graph.

Why: the eager decode step is ~25 small kernels a layer launched one by one from Python. On an H200 the 0.8B shape
decoded at 32-40 tok/s and the 9B at 19-43, bound by those launches and not by the GPU (benchmarks/gpu/). A CUDA
graph records the whole step once and replays it in one launch.

A graph fixes every shape and address, so the step it records (`StaticStep.run`) is the eager step's math
(layers.py's functions, Forward's layer loop) with the two things that vary between tokens held in device tensors
the graph reads: the token id and its position. Attention covers the state's whole KV capacity with the positions
after the token masked (`layers.attend_at`) instead of slicing the cache to the position. A graph belongs to one
DecodeState (its tensors' addresses): `GraphDecoder` keeps one per live state (a graph holds no reference to the
state: it goes, with its memory, when the state does).

The first token of a state runs the step eagerly (the real step: it moves the state) and then records it; recording
runs nothing.

Off by default for now: `DELTASERVE_CUDA_GRAPH=on` turns graphs on. The recorded step's math is checked on the CPU
against the eager step (tests/test_graph_step.py), but no GPU has recorded and replayed it yet: tests/test_cuda.py's
graph test and scripts/gpu_speed.py's graph-vs-eager figures are waiting for a session with a GPU, after which
the default should become on.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from deltaserve.engine import layers as L
from deltaserve.engine.state import DecodeState
from deltaserve import settings

GRAPH_ENV = "DELTASERVE_CUDA_GRAPH"
MAX_GRAPHS = 8  # states with a graph kept at once (a server's slots); the least recently used one goes first


def graphs_enabled(device: torch.device) -> bool:
    """Whether a Forward on this device replays its one-sequence decode steps as CUDA graphs."""
    return device.type == "cuda" and settings.current().cuda_graph


class StaticStep:
    """The one-token decode of `state` with every shape fixed by the state's capacity: `run()` reads the token id
    from `token` and its position from `pos` (device tensors), updates the state in place at that position and
    returns the logits [vocab]. Runs eagerly anywhere; a CUDA graph records it on a CUDA device."""

    def __init__(self, forward, state: DecodeState):
        self.forward, self.state = forward, state
        dev = state.device
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.columns = torch.arange(state.capacity, device=dev)
        self.key = state_key(state)

    def set(self, token: int, position: int) -> None:
        self.token.fill_(token)
        self.pos.fill_(position)

    def run(self) -> torch.Tensor:
        f, c, st = self.forward, self.forward.config, self.state
        rope = L.rope_tables(self.pos, c.rotary_dim, c.rope_theta)  # device ops only: recordable
        after = self.columns > self.pos  # the cache positions this token does not see

        def attention(i, h, mw):
            k_cache, v_cache = st.kv[i]
            q, k, v, gate = L._attention_qkv(h, mw, c, rope)
            o = L.attend_at(q, k, v, k_cache, v_cache, self.pos, after)
            return mw.o(o * torch.sigmoid(gate.float()))

        def deltanet(i, h, mw):
            return L.deltanet_mixer(h, mw, c, st.conv[i], st.ssm[i], chunked=False, native=False)

        x = f._layers(f.weights.embed.lookup(self.token), attention, deltanet)
        return f._head(x)[0]


def state_key(state: DecodeState) -> tuple:
    """What a graph of this state depends on: the addresses of its tensors (a new or grown state has others)."""
    ptrs = [t.data_ptr() for pair in state.kv.values() for t in pair]
    ptrs += [t.data_ptr() for t in state.conv.values()] + [t.data_ptr() for t in state.ssm.values()]
    return (id(state), state.capacity, tuple(ptrs))


class GraphDecoder:
    """The CUDA graphs of one Forward's decode steps, one per DecodeState (`MAX_GRAPHS` at most)."""

    def __init__(self, forward):
        self.forward = forward
        self.graphs: OrderedDict[int, tuple[StaticStep, torch.cuda.CUDAGraph, torch.Tensor]] = OrderedDict()
        self.recorded = 0  # graphs recorded so far (tests, the route line)

    def decode(self, state: DecodeState, token: int) -> torch.Tensor:
        """One token through the graph of this state (recorded at its first token); the state advances by one.
        Returns the logits [vocab] (a tensor of the caller's own)."""
        entry = self.graphs.get(id(state))
        if entry is not None and entry[0].key != state_key(state):
            del self.graphs[id(state)]
            entry = None
        if entry is None:
            return self._first(state, token)
        step, graph, out = entry
        self.graphs.move_to_end(id(state))
        step.set(token, state.length)
        graph.replay()
        state.length += 1
        return out.clone()

    def _first(self, state: DecodeState, token: int) -> torch.Tensor:
        step = StaticStep(self.forward, state)
        # the unused tail of the cache is weighted 0 by the masked softmax, and 0 x a non-finite value is NaN
        for k, v in state.kv.values():
            k[:, state.length:].zero_()
            v[:, state.length:].zero_()
        step.set(token, state.length)
        key = id(state)
        stream = torch.cuda.Stream(device=state.device)
        stream.wait_stream(torch.cuda.current_stream(state.device))
        with torch.cuda.stream(stream):
            logits = step.run().clone()  # the real step, eagerly (it also warms the libraries up for recording)
        torch.cuda.current_stream(state.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step.run()
        step.state = None  # recorded: the replays need only the tensors' addresses
        self.graphs[key] = (step, graph, out)
        weakref.finalize(state, self.graphs.pop, key, None)
        self.recorded += 1
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        state.length += 1
        return logits
