"""A turn's decode loop, as a part of `Session` (session/resident.py): sample, mask, check the stops, hand each token
out, and feed it back through the engine loop; with the MTP block, a token and its drafts verified in one chain and
rolled back to what was kept. The session's turn (`Session._turn`) runs it as the coroutine the engine loop steps
(runtime/engine.py): it yields its forwards (`Rows`) and samples between them.
"""

from __future__ import annotations

import time

import torch

from deltaserve.engine.state import DecodeState
from deltaserve.errors import BackendError
from deltaserve.runtime import capacity as cap
from deltaserve.runtime.engine import Cancelled, Rows
from deltaserve.session.drafting import DEFAULT_DRAFTS, DraftPolicy
from deltaserve.session.grammar import GrammarError
from deltaserve.session.sampling import Sampler
from deltaserve.text.stream import StopCutter

TOKEN_ROWS = 8  # rows one native decode call takes (native.h's DS_MAX_ROWS): a verification's token and drafts


class DecodeLoop:
    """The decode loop and the drafting policy of a `Session` (a base class of it: it reads the session's state,
    backend, host and notices)."""

    def _drafting(self) -> DraftPolicy | None:
        """Whether this session drafts with the MTP block, said once: on by default where the file carries one and
        the route runs it (up to DEFAULT_DRAFTS a step, adaptive), `mtp=N` at most N, `mtp=0` off."""
        asked, forward = self.mtp_asked, self.backend.forward
        if asked == 0:
            return None
        if forward is None or forward.mtp is None:
            if asked:
                self.say(f"[deltaserve] MTP: {asked} draft tokens asked for, and {self.host.path.name} carries no MTP "
                         f"block (nextn tensors): decoding without drafts")
            return None
        if self.backend.accelerator:
            self.say("[deltaserve] MTP: speculative decoding runs on the CPU route only so far: not used on "
                     f"{self.backend.name}")
            return None
        most = asked or DEFAULT_DRAFTS
        if most > TOKEN_ROWS - 1:
            self.say(f"[deltaserve] MTP: {most} draft tokens asked for; a verification takes at most {TOKEN_ROWS} rows: "
                     f"drafting up to {TOKEN_ROWS - 1}")
            most = TOKEN_ROWS - 1
        self.say(f"[deltaserve] MTP: drafting up to {most} tokens a step with the file's MTP block "
                 f"({'as asked' if asked else 'default'}; each step takes the count with the most tokens per second "
                 f"measured, 0 where drafts do not pay), {forward.mtp.why}; every token is the model's own (verified "
                 f"in one pass, rolled back without a second)")
        # what earlier sessions of this model measured in this process (the costs are the model's)
        policy = DraftPolicy.learned_from(getattr(self.host, "draft_policy", None), most)
        if policy.off:
            self.say(f"[deltaserve] MTP: drafts did not pay for this model in this process ({policy.why_off()}): "
                     f"decoding without them")
        return policy

    def drafting_stats(self) -> dict | None:
        """Speculative decoding since the session started (None: it does not draft): the most drafts a step, drafted
        and accepted tokens, the acceptance, the running acceptance per draft position, and the tokens per second the
        policy measured for each draft count (what it decides on)."""
        p = self._policy
        if p is None:
            return None
        return {"most": p.most, "drafted": p.drafted, "accepted": p.accepted,
                "acceptance": round(p.accepted / p.drafted, 4) if p.drafted else None,
                "per_position": [round(a, 3) for a in p.accept],
                "tokens_per_s_by_drafts": {str(k): round(r, 1) for k, r in sorted(p.rate.items())}}

    def _speculative_bytes(self, capacity: int) -> int:
        policy = getattr(self, "_policy", None)
        return cap.speculative_bytes(self.host.config, capacity, policy.most) if policy is not None else 0

    def _give_up_drafting(self) -> None:
        """Drafts measured not to pay (`DraftPolicy.off`): the state's MTP cache is dropped (following it costs a
        block per token), said once."""
        if self.state is not None and self.state.mtp is not None:
            self.state.mtp = None
            self.say(f"[deltaserve] MTP: drafts do not pay for this model here ({self._policy.why_off()}): decoding "
                     f"without them from now on")

    def _attach_drafting(self) -> None:
        """A new state gets the MTP block's cache and the rollback snapshots (planned with it: `_plan`)."""
        if self._policy is not None and self._policy.off:
            return
        if self._policy is not None and self.state is not None and not self.backend.accelerator:
            forward = self.backend.forward
            self.state.mtp = forward.mtp.new_cache(self.state.capacity)
            if self._snaps is None or len(self._snaps.rows) < self._policy.most:
                self._snaps = forward.new_snapshots(self._policy.most)

    def _decode(self, prompt, logits, budget, params, stop_ids, stop_texts, on_token, t0, grammar=None, thought=None):
        """Sample, hand out, feed back; until a stop token or string, the budget, or a cancel. With a grammar, each
        step's logits are masked to what it allows (stop tokens only where it can end) and the sampled token
        advances it; a grammar left with nothing but a stop ends the turn ("stop").

        With drafting on (`_policy`), a token is fed with the MTP block's drafts after it, verified in one chain
        (`_speculate`): the rows' logits are then sampled in order exactly as the plain loop samples them, and a
        draft equal to the token sampled is already fed (its row is next); the first that differs, or the turn's end,
        rolls the state back to the rows kept. Every token is sampled from the model's own logits, so the output
        is the plain loop's (greedy: token for token; sampled: the same distribution, each token one draw).

        `thought` (session/thinking.py, marked [thinking]): a prompt that opened a thought; its `step` may put the
        closing in place of the sampled token (what is fed is what is taken), the grammar sleeps until the closing is
        written, and `after` gives the answer its own token budget."""
        sampler = Sampler(params)
        vocab = self.host.config.vocab_size
        # a penalty's ids: text only (an image's placeholder ids, this turn's or the state's, are past the vocabulary)
        seen = [t for t in prompt if t < vocab] if max(prompt) >= vocab else prompt
        constraint = grammar.constraint() if grammar is not None else None
        if thought is not None:  # [thinking] the grammar starts after the thought's closing
            constraint = thought.gate(constraint)
        stream = _TextStream(self.tokenizer, stop_texts)
        generated: list[int] = []
        finish = "length"
        ttft = 0.0
        decode_t0 = time.perf_counter()
        seq = list(prompt)  # the tokens decided so far, the last one fed (with drafts after it while verifying)
        rows, drafts, i = [logits], [], 0  # rows[i] follows seq; drafts[i] was fed after it
        verifying: tuple[int, int] | None = None  # the verification to settle: (its first position, its rows)
        step: tuple[int, float] | None = None  # the step running (its draft count, when it fed), for the policy
        drafted = accepted = 0
        self._turn_drafts = (0, 0)

        def settle(kept: int) -> None:
            """Keep `kept` rows of the pending verification, roll back the rest."""
            nonlocal verifying, drafted, accepted
            if verifying is None:
                return
            at, n = verifying
            verifying = None
            if kept < n:
                with self._or_forget(f"the rollback to position {at + kept} failed"):
                    self.backend.rollback(self.state, self._snaps, kept, n)
            self.held = self.held[:at + kept]
            drafted += n - 1
            accepted += kept - 1
            self._policy.record_drafts(n - 1, kept - 1)

        try:
            while len(generated) < budget:
                logits = rows[i]
                if constraint is not None:
                    if constraint.done():
                        finish = "stop"
                        break
                    logits = constraint.mask(logits)
                token = sampler(logits, seen, generated)
                if thought is not None:  # [thinking] the closing in its place (budget spent, a loop, being written)
                    token = thought.step(token)
                if self._recorder is not None:  # log-probabilities (session/logprobs.py): the row the sampler saw
                    self._recorder.add(logits, token)
                if not generated:
                    ttft = time.perf_counter() - t0
                    decode_t0 = time.perf_counter()
                if token in stop_ids:
                    finish = "stop"
                    break
                if constraint is not None and not constraint.accept(token):
                    if not bool(torch.isfinite(logits).any()):  # the grammar allows nothing this vocabulary holds
                        raise GrammarError(
                            f"response_format: after {len(generated)} generated tokens the schema allows no token "
                            "this model may write inside JSON (strings are never given a control character, "
                            "U+0000-U+001F: a pattern, const or enum that needs one cannot be met); refused, nothing "
                            "was cut short")
                    raise BackendError(f"internal: the grammar refused token {token}, which its mask allowed")
                generated.append(token)
                if thought is not None:  # [thinking] the answer's own max_tokens once the closing is written
                    budget = thought.after(budget, len(generated))
                piece, hit_stop = stream.push(token)
                if on_token is not None and on_token(token, piece) is False:
                    finish = "cancelled"
                    break
                if hit_stop:
                    finish = "stop"
                    break
                if len(generated) >= budget:
                    if constraint is not None and constraint.done():
                        finish = "stop"  # the answer closed on the budget's last token
                    break
                seq.append(token)
                if i < len(drafts) and token == drafts[i]:  # the draft was right: fed already, its row is next
                    i += 1
                    continue
                settle(i + 1)
                now = time.perf_counter()
                if step is not None:  # the step that ends here made i + 1 tokens (its rows sampled)
                    self._policy.record_step(step[0], i + 1, now - step[1])
                    self.host.draft_policy = self._policy  # the next session of this model starts from it
                    step = None
                    if self._policy.off:
                        self._give_up_drafting()
                k = 0
                if self._policy is not None and not self._policy.off:
                    # drafts past the budget could not be kept: room for them and the verification's own token
                    k = self._policy.choose(min(budget - len(generated) - 1, self.state.capacity - len(seq)))
                    step = (k, now)
                try:
                    if k > 0:
                        rows, drafts, verifying = yield from self._speculate(seq, k, constraint, stop_ids)
                    else:
                        logits, _ = yield from self._feed(seq, len(seq) - 1, None)
                        rows, drafts = [logits], []
                except Cancelled:  # the client left: this token is not fed (the state holds what came before it)
                    finish = "cancelled"
                    break
                i = 0
        finally:
            if verifying is not None and self.state is not None and self.held:
                settle(i + 1)  # the turn ended on row i: the rows after it are not kept
        decode_s = time.perf_counter() - decode_t0 if generated else 0.0
        tail = stream.finish()
        if tail and on_token is not None and finish != "cancelled":
            on_token(None, tail)
        self._turn_drafts = (drafted, accepted)
        return generated, stream.text, finish, ttft, decode_s

    def _speculate(self, seq: list[int], k: int, constraint, stop_ids):
        """Feed seq's last token with up to k drafts after it, verified in one chain (a coroutine: the engine loop
        runs the chain's rows with the other sequences' in one forward): the rows' logits, the drafts, and the
        verification to settle (its first position and its rows)."""
        state, token = self.state, seq[-1]
        if state.length != len(seq) - 1:
            raise BackendError(f"internal: the state holds {state.length} positions, expected {len(seq) - 1}")
        try:
            with self._or_forget(f"the verification at position {len(seq) - 1} failed"):
                drafts = self.backend.run(self._draft, state, token, k, constraint, stop_ids)
                self.held = []  # until the verification completes, what the state holds is not trusted
                logits = yield Rows(self.backend, state, [token] + drafts, self._snaps if drafts else None)
        except Cancelled:
            self.held = list(seq[:state.length])
            raise
        self.held = list(seq) + drafts
        return list(logits), drafts, (len(seq) - 1, len(drafts) + 1)

    def _draft(self, state: DecodeState, token: int, k: int, constraint, stop_ids) -> list[int]:
        """Up to k greedy drafts after `token` from the MTP block, masked by the grammar where there is one (its
        matcher advanced over them, then rolled back); drafting stops at a stop token."""
        mtp = self.backend.forward.mtp
        logits, out = mtp.first(state.mtp, token)
        drafts: list[int] = []
        for j in range(k):
            if constraint is not None:  # the grammar's mask over the whole vocabulary
                logits = constraint.mask(mtp.full(logits))
                if not bool(torch.isfinite(logits).any()):
                    break
                d = int(logits.argmax())
            else:
                d = mtp.token(int(logits.argmax()))
            if d in stop_ids or (constraint is not None and not constraint.accept(d)):
                break
            drafts.append(d)
            if j + 1 < k:
                logits, out = mtp.next(state.mtp, state.length + 1 + j, d, out)
        if constraint is not None:
            constraint.rollback(len(drafts))
        return drafts


class _TextStream:
    """Detokenises a generation as it goes and cuts it at the first stop string (not included)."""

    def __init__(self, tokenizer, stops: list[str]):
        from deltaserve.text.tokenizer import StreamDecoder

        self.dec = StreamDecoder(tokenizer)
        self.cut = StopCutter(stops)
        self.text = ""  # text handed out so far (never includes a stop string)

    def push(self, token: int) -> tuple[str, bool]:
        out, hit = self.cut.push(self.dec.feed(token))
        self.text += out
        return out, hit

    def finish(self) -> str:
        rest = self.cut.flush() + ("" if self.cut.stopped else self.dec.flush())
        self.text += rest
        return rest
