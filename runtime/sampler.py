"""Token selection and token-level stop rules.

For one row of logits ``z`` (float32, [vocab]) and a request's ``SamplingParams``:

    logit_bias, first:          z_j += bias_j for each (j, bias_j)
    min_tokens, while fewer tokens were generated: z_j = -inf for the eos ids (unless
                                ignore_eos) and the stop_token_ids
    penalties (``SamplingParams.penalized``), on the request's tokens so far
    (``penalize_rows_``; c_j = count of token j among the generated tokens):
                                r = repetition_penalty: z_j = z_j / r if z_j > 0 else z_j * r
                                       for every j in the prompt or the output
                                z_j -= frequency_penalty * c_j + presence_penalty * [c_j > 0]
    greedy (temperature < 1e-5, ``SamplingParams.greedy``):
                                next = argmax_j z_j            (lowest index on ties)
    otherwise:                  z' = (z - max_j z_j) / temperature   (the shift leaves softmax
                                       unchanged and keeps z' <= 0, so no overflow)
                                min_p > 0: z'_j = -inf where exp(z'_j) < min_p, i.e. where
                                           p_j < min_p * max_i p_i (as z'_max = 0; vLLM's
                                           order: after temperature, before top-k and top-p)
                                top_k > 0: z'_j = -inf where z'_j < the k-th largest z' (tokens tied
                                           with the k-th are all kept, as vLLM and transformers do)
                                top_p < 1: keep the smallest prefix of tokens sorted by
                                           probability whose mass reaches top_p: token j (in
                                           descending order) stays iff the mass before it is
                                           < top_p (vLLM's and transformers' line; the most
                                           likely token is always kept)
                                next ~ Categorical(softmax(z'))  drawn with the request's own
                                       torch.Generator, so a seeded request gives the same
                                       tokens whatever else is in the batch.

A row whose logits hold NaN or +inf, or are all -inf (a broken checkpoint or an overflow in
the model), has no distribution to draw from and no meaningful argmax: ``sample`` returns a
``NoToken`` with the reason for it, and the engine ends that request with an error, leaving
every other row and the engine running. The request's own adjustments cannot break a healthy
row that way: a repetition penalty is used as its nearest float32 in [tiny, max] (so never 0 or
inf, and 0 * r is never NaN), a logit pushed past float32's range to +inf by ``z_j / r`` is
held at float32's max (it still dominates the row), and a row that the adjustments leave all
-inf (every token banned) gets its own ``NoToken`` reason.

Logprobs (``SamplingParams.logprobs`` = k): ``log_softmax(z)`` of the raw row (before
logit_bias, min_tokens, penalties, temperature, min-p, top-k and top-p), the sampled token's entry and
the k largest (``Sampler.logprobs``).

Stop rules after a token is appended (the string-level ``stop`` rule lives in
``runtime.detokenizer``): eos (unless ignore_eos) or a ``stop_token_ids`` member gives
"stop"; reaching ``max_tokens`` gives "length".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch
from torch import Tensor

from runtime.request import ErrorKind, FinishReason, SamplingParams, TokenLogprobs

History = tuple[Sequence[int], Sequence[int]]  # (prompt token ids, generated token ids) of one request

MASK_64 = (1 << 64) - 1


def generator_for(seed: int) -> torch.Generator:
    """A request's own CPU generator for ``seed`` in [0, 2^64).

    torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so ``s`` and
    ``s + k * 2^32`` drew the same tokens. A seed below 2^32 seeds it as it is; a larger one
    is first mixed down to 32 bits (splitmix64's finaliser, then the two halves xor-ed), so
    seeds that differ only in their high bits get unrelated streams. There are still only
    2^32 streams: two random 64-bit seeds share one with probability 2^-32.
    """
    if seed >= 1 << 32:
        z = seed & MASK_64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
        z ^= z >> 31
        seed = (z ^ (z >> 32)) & 0xFFFFFFFF
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True)
class NoToken:
    """What ``Sampler.sample`` gives a row it cannot draw from: the reason the request fails, and
    whose fault it is (``ErrorKind``)."""

    reason: str
    kind: ErrorKind


NON_FINITE_LOGITS = NoToken("the model produced non-finite logits (NaN or inf) for this request", "engine")
EVERY_TOKEN_BANNED = NoToken("logit_bias, min_tokens and the penalties left no token with a finite logit for this request", "request")


class Sampler:
    """Picks one token per logits row; owns one torch.Generator per sampling request."""

    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = ()) -> None:
        # Seeds for requests that bring none are drawn from this generator, so one engine
        # run is reproducible given the engine's seed.
        self._seed_source = generator_for(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._eos_token_ids = tuple(eos_token_ids)  # what min_tokens holds back, besides stop_token_ids
        # Repetition penalty: each request's prompt ids as a tensor on the logits' device, built once.
        self._prompt_ids: dict[str, Tensor] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        if params.greedy:
            return
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**32, (1,), generator=self._seed_source).item())  # as many streams as there are
        self._generators[request_id] = generator_for(seed)

    def remove(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._prompt_ids.pop(request_id, None)

    def sample(
        self, logits: Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams], histories: Optional[Sequence[History]] = None
    ) -> list[Union[int, NoToken]]:
        """One token per row of ``logits`` [n, vocab]; a ``NoToken`` for a row with NaN or +inf
        logits or all -inf, or that logit_bias, min_tokens and penalties leave all -inf.

        ``histories``: each row's (prompt, generated) token ids, needed by rows whose params
        adjust the logits (``SamplingParams.adjusts_logits``)."""
        if logits.dim() != 2 or logits.shape[0] != len(request_ids) or len(params) != len(request_ids):
            raise ValueError(f"sample: logits {tuple(logits.shape)} do not match {len(request_ids)} requests")
        if histories is not None and len(histories) != len(request_ids):
            raise ValueError(f"sample: {len(histories)} histories for {len(request_ids)} requests")
        logits = logits.float()
        broken = ((torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1) | torch.isneginf(logits).all(dim=-1)).tolist()
        adjusted = [i for i, p in enumerate(params) if p.adjusts_logits and not broken[i]]
        if adjusted:
            if histories is None:
                raise ValueError("sample: logit_bias, min_tokens and penalties need each request's token history (histories=...)")
            logits = logits.clone(memory_format=torch.contiguous_format)
            self._bias_and_hold_back(logits, [(i, params[i], len(histories[i][1])) for i in adjusted])
        penalized = [i for i in adjusted if params[i].penalized]
        if penalized:
            prompts = []
            for i in penalized:
                prompt_ids = self._prompt_ids.get(request_ids[i])
                if prompt_ids is None and params[i].repetition_penalty != 1:
                    prompt_ids = self._prompt_ids[request_ids[i]] = torch.tensor(list(histories[i][0]), dtype=torch.long, device=logits.device)
                prompts.append(prompt_ids)
            penalize_rows_(logits, penalized, [params[i] for i in penalized], prompts, [histories[i][1] for i in penalized])
        out: list[Union[int, NoToken]] = [NON_FINITE_LOGITS if b else EVERY_TOKEN_BANNED for b in broken]
        if adjusted:
            banned = torch.isneginf(logits[adjusted]).all(dim=-1).tolist()
            for i, all_banned in zip(adjusted, banned):
                broken[i] = all_banned
        greedy_rows = [i for i, p in enumerate(params) if p.greedy and not broken[i]]
        if greedy_rows:
            picked = logits[greedy_rows].argmax(dim=-1).tolist()
            for i, tok in zip(greedy_rows, picked):
                out[i] = int(tok)
        for i, p in enumerate(params):
            if not p.greedy and not broken[i]:
                out[i] = sample_row(logits[i], p, self._generators[request_ids[i]])
        return out

    def _bias_and_hold_back(self, logits: Tensor, rows: Sequence[tuple[int, SamplingParams, int]]) -> None:
        """``logit_bias`` and ``min_tokens`` in place, for (row, params, tokens generated so far); one
        ``index_put_`` each over every row's entries."""
        bias_rows, bias_ids, bias_values, ban_rows, ban_ids = [], [], [], [], []
        for i, p, generated in rows:
            for token, value in p.logit_bias:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(float(value))
            if generated < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self._eos_token_ids))
                ban_rows.extend([i] * len(banned))
                ban_ids.extend(sorted(banned))
        device = logits.device
        if bias_rows:
            index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device))
            logits.index_put_(index, torch.tensor(bias_values, dtype=logits.dtype, device=device), accumulate=True)
        if ban_rows:
            index = (torch.tensor(ban_rows, device=device), torch.tensor(ban_ids, device=device))
            logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))

    @staticmethod
    def logprobs(logits: Tensor, tokens: Sequence[Union[int, NoToken]], params: Sequence[SamplingParams]) -> list[Optional[TokenLogprobs]]:
        """For each row whose params ask for logprobs and that got a token: the token's
        ``log_softmax`` entry and the ``params.logprobs`` largest ones, from the raw ``logits``
        (before logit_bias, min_tokens, penalties, temperature, min-p, top-k and top-p); None for the other rows
        (``token_logprobs`` does the work)."""
        rows = [i for i, (tok, p) in enumerate(zip(tokens, params)) if isinstance(tok, int) and p.logprobs is not None]
        out: list[Optional[TokenLogprobs]] = [None] * len(tokens)
        if rows:
            picked = token_logprobs(logits, [int(tokens[i]) for i in rows], [params[i].logprobs for i in rows], rows)
            for i, entry in zip(rows, picked):
                out[i] = entry
        return out


LOGPROB_ROWS_PER_BLOCK = 256  # prompt logprobs of a long chunk: bounded temporaries (256 x vocab floats at a time)


def token_logprobs(logits: Tensor, tokens: Sequence[int], ks: Sequence[int], rows: Optional[Sequence[int]] = None) -> list[TokenLogprobs]:
    """Row ``rows[i]`` of ``logits`` [n, vocab] (row i without ``rows``): ``tokens[i]``'s entry of
    ``log_softmax`` and its ``ks[i]`` largest entries. One ``log_softmax``, ``gather`` and ``topk``
    per block of ``LOGPROB_ROWS_PER_BLOCK`` rows, so a 2048-token prompt chunk over a 150k
    vocabulary never holds more than one block's float32 copy besides ``logits`` itself."""
    out: list[TokenLogprobs] = []
    for lo in range(0, len(tokens), LOGPROB_ROWS_PER_BLOCK):
        hi = min(lo + LOGPROB_ROWS_PER_BLOCK, len(tokens))
        block = logits[lo:hi] if rows is None else logits.index_select(0, torch.tensor(rows[lo:hi], device=logits.device))
        lp = torch.log_softmax(block.float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(list(tokens[lo:hi]), device=lp.device)[:, None]).squeeze(1).tolist()
        values, ids = lp.topk(min(max(ks[lo:hi]), lp.shape[-1]), dim=-1)
        values, ids = values.tolist(), ids.tolist()
        for i, (tok, k) in enumerate(zip(tokens[lo:hi], ks[lo:hi])):
            out.append(TokenLogprobs(tok, float(chosen[i]), tuple(zip(ids[i][:k], values[i][:k]))))
    return out


def penalize_rows_(
    z: Tensor, rows: Sequence[int], params: Sequence[SamplingParams], prompts: Sequence[Optional[Tensor]], outputs: Sequence[Sequence[int]]
) -> None:
    """The penalties, in place, for the (distinct) rows ``rows`` of the float32 ``z`` [n, vocab] at once. For
    row rows[i], with r its repetition_penalty (``params[i]``) and c_j the count of token j in
    ``outputs[i]``:

        z_j = z_j / r if z_j > 0 else z_j * r     for j in the prompt or the output
        z_j -= frequency_penalty * c_j + presence_penalty * [c_j > 0]

    Only the entries a row has seen are touched: they are named by flat indices
    ``row * vocab + token``, made distinct by ``unique`` (one for the seen entries of the
    repetition penalty, one with counts for the generated ones), each read with a gather and
    written back with a scatter, so the cost follows the tokens seen, not
    rows x vocab.
    ``prompts[i]``: row rows[i]'s prompt ids as a long tensor on ``z``'s device, needed
    where its repetition penalty is not 1. Token ids are the model's (the model runner refuses
    others).

    r is used as its nearest float32 in [tiny, max], and a ``z_j / r`` past float32's range is
    held at float32's max rather than +inf, so finite rows stay finite: no NaN from 0 * inf or
    from inf - inf when the row is shifted by its max."""
    if z.dtype != torch.float32 or not z.is_contiguous():
        raise ValueError(f"penalize_rows_: needs a contiguous float32 tensor, got {z.dtype}")
    vocab = z.shape[1]
    flat = z.view(-1)
    device = z.device
    finfo = torch.finfo(torch.float32)

    def per_entry(values: list[float], entries: Tensor) -> Tensor:
        """``values[i]`` for each flat entry of row rows[i]."""
        by_row = torch.zeros(z.shape[0], dtype=torch.float32, device=device)
        by_row[torch.tensor(list(rows), device=device)] = torch.tensor(values, dtype=torch.float32, device=device)
        return by_row[torch.div(entries, vocab, rounding_mode="floor")]

    output_flat = torch.tensor([row * vocab + t for row, out in zip(rows, outputs) for t in out], dtype=torch.long, device=device)
    repeat = [p.repetition_penalty for p in params]
    if any(r != 1 for r in repeat):
        seen_parts = [output_flat] + [prompt + row * vocab for row, prompt, r in zip(rows, prompts, repeat) if r != 1 and prompt is not None]
        seen = torch.unique(torch.cat(seen_parts))
        r = per_entry(repeat, seen).clamp(finfo.tiny, finfo.max)  # 1 for rows without the penalty: their entries stay as they are
        values = flat[seen]
        flat[seen] = torch.where(values > 0, (values / r).clamp(max=finfo.max), values * r)
    if output_flat.numel():
        generated, counts = torch.unique(output_flat, return_counts=True)
        freq = per_entry([p.frequency_penalty for p in params], generated)
        pres = per_entry([p.presence_penalty for p in params], generated)
        flat[generated] = flat[generated] - freq * counts.float() - pres


def filtered_logits(z: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, min-p, top-k and top-p applied to one row (see module docstring)."""
    z = z.float()
    z = (z - z.max()) / params.temperature
    vocab = z.shape[-1]
    if params.min_p > 0.0:  # p_j / p_max = exp(z'_j - 0); the most likely token (z' = 0) always stays
        z = z.masked_fill(torch.exp(z) < params.min_p, float("-inf"))
    if 0 < params.top_k < vocab:
        kth = torch.topk(z, params.top_k).values[-1]
        z = torch.where(z < kth, torch.full_like(z, float("-inf")), z)
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p  # token j is dropped once the mass before it suffices
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def sample_row(z: Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One draw with the request's own generator, on the CPU: the generators are CPU ones (a
    CUDA or NPU ``multinomial`` refuses them), and one row of probabilities is cheap to move."""
    probs = torch.softmax(filtered_logits(z.cpu(), params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_stop_reason(
    token: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: Iterable[int]
) -> Optional[FinishReason]:
    """Finish reason after appending ``token`` (the request's ``num_output_tokens``-th), or None."""
    if token in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and token in set(eos_token_ids):
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None
