"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from how the context's last tokens
continued before, in the request's own tokens and in its tenant's recent outputs, the most
frequent continuation first.

Prompt lookup (`NgramProposer`) takes the latest earlier occurrence of the longest matching
n-gram and copies what followed it. Here every recent occurrence of the context's tail votes:

- Occurrences: the context's last `MIN_MATCH` tokens (the latest `MAX_OCCURRENCES`) and its last
  `LONG_KEY` tokens (older long matches the short key's most recent ones would crowd out), found
  in the request's own prompt and output (the latest `WINDOW` tokens) and, separately, in the
  tenant's recent outputs (`TenantOutputs`: one store per cache salt, nothing crosses a salt,
  bounded). Each occurrence's match is the length of the context's tail it agrees with, up to
  `MAX_MATCH` (what a suffix tree of depth `MAX_MATCH` would find).
- For a match length m, the occurrences matching at least m tokens vote at each draft position:
  the draft takes the most frequent next token, the occurrences that disagree (or end) drop out,
  and the position's estimated probability is the product of the winning shares so far. The
  draft stops where that estimate falls under `MIN_TOKEN_PROB`, or at `SPEC_FACTOR` x m tokens
  (a short match earns a short draft).
- Among a few match lengths (the longest found, and `MATCH_THRESHOLDS`), and between the
  request's own tokens and the tenant's outputs, the draft with the largest expected accepted
  length (the sum of its estimates) wins.

Signals for the gate: the winning match's share of `MAX_MATCH`, and its first token's estimate.
The search runs in C (`bytearray.rfind` over the tokens packed as int64 bytes, kept to whole
tokens); the voting in Python over at most `MAX_OCCURRENCES + LONG_OCCURRENCES` short runs.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.request import Request
from deepinfer.scheduler.draft_gate import LONG_DRAFT_TOKENS, Draft
from deepinfer.scheduler.prediction import find_aligned

MIN_MATCH = 2
"""Shortest tail matched (one token, a newline or a bracket, occurs everywhere in code)."""
LONG_KEY = 8
"""Length of the second, longer key looked up."""
MAX_MATCH = 24
"""Longest match measured (a suffix tree's depth)."""
MAX_OCCURRENCES = 48
"""Occurrences of the short key taken, latest first."""
LONG_OCCURRENCES = 16
"""Occurrences of the long key taken, latest first."""
MATCH_THRESHOLDS = (16, 8, 4, MIN_MATCH)
"""Match lengths (besides the longest found) whose voters are tried: a suffix tree's nodes on
the way down, a few of them (each costs a vote)."""
MIN_TOKEN_PROB = 0.1
"""A draft stops where its estimated probability would fall under this."""
SPEC_FACTOR = 2.0
"""A match of m tokens drafts at most this many times m tokens."""
SUFFIX_DRAFT_TOKENS = LONG_DRAFT_TOKENS
"""Most drafts one proposal holds (the gate cuts them to what pays)."""
WINDOW = 16384
"""The request's latest tokens searched."""
TENANT_TOKENS = 65536
"""Output tokens each tenant's store keeps (the oldest outputs leave first)."""
MAX_TENANTS = 64
"""Tenants whose outputs are kept (the least recently used leaves first)."""

_WIDTH = 8  # bytes of one packed token (int64)
_SEPARATOR = -1
"""Between two outputs in a tenant's store: no token equals it, so no match crosses it."""
_SEPARATOR_BYTES = array("q", [_SEPARATOR]).tobytes()


@dataclass(frozen=True)
class SuffixDraft:
    """A scored draft: its tokens, each position's estimated probability, the match length."""

    token_ids: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match: int = 0

    @property
    def score(self) -> float:
        """Expected accepted length: the sum of the estimates."""
        return sum(self.probs)


class TenantOutputs:
    """Recent outputs of each tenant (cache salt), packed, separated by `_SEPARATOR`: at most
    `TENANT_TOKENS` tokens for each of at most `MAX_TENANTS` tenants."""

    def __init__(self, max_tokens: int = TENANT_TOKENS, max_tenants: int = MAX_TENANTS) -> None:
        self.max_tokens, self.max_tenants = max_tokens, max_tenants
        self._stores: OrderedDict[str | None, bytearray] = OrderedDict()

    def add(self, tenant: str | None, token_ids: Sequence[int]) -> None:
        """Keep an output (its last `max_tokens - 1` tokens: the oldest outputs leave to make
        room, and one output never pushes itself out)."""
        if not token_ids:
            return
        store = self._stores.pop(tenant, None) or bytearray(_SEPARATOR_BYTES)
        self._stores[tenant] = store
        packed = array("q", token_ids[-(self.max_tokens - 1) :]).tobytes()
        store += packed + _SEPARATOR_BYTES
        excess = len(store) - (self.max_tokens + 1) * _WIDTH
        if excess > 0:  # cut at the separator that ends the last output to leave
            cut = find_aligned(store, _SEPARATOR_BYTES, excess)
            del store[: cut if cut >= 0 else len(store) - _WIDTH]
        while len(self._stores) > self.max_tenants:
            self._stores.popitem(last=False)

    def get(self, tenant: str | None) -> bytearray | None:
        return self._stores.get(tenant)

    def num_tokens(self, tenant: str | None) -> int:
        """Tokens kept for the tenant, separators included."""
        store = self._stores.get(tenant)
        return len(store) // _WIDTH if store is not None else 0


@dataclass
class _Context:
    packed: bytearray
    tenant: str | None
    num_prompt_tokens: int


class SuffixProposer:
    """See the module docstring. `outputs`: the tenants' stores (shared with whoever else
    should see them; a new one by default)."""

    name = "suffix"
    num_signals = 2
    max_draft_tokens: int | None = SUFFIX_DRAFT_TOKENS

    def __init__(self, outputs: TenantOutputs | None = None) -> None:
        self.outputs = outputs if outputs is not None else TenantOutputs()
        self._contexts: dict[str, _Context] = {}

    def propose(self, request: Request, max_tokens: int) -> Draft:
        found = self.suffix_draft(request, max_tokens)
        if not found.token_ids:
            return Draft()
        return Draft(found.token_ids, (min(found.match / MAX_MATCH, 1.0), found.probs[0]))

    def suffix_draft(self, request: Request, max_tokens: int) -> SuffixDraft:
        """The best-scoring draft of at most `max_tokens` tokens (empty when nothing matched)."""
        if max_tokens <= 0:
            return SuffixDraft()
        ctx = self._context(request)
        n = len(ctx.packed) // _WIDTH
        if n <= MIN_MATCH:
            return SuffixDraft()
        limit = min(max_tokens, SUFFIX_DRAFT_TOKENS)  # a draft's runs: one list each
        tail = bytes(ctx.packed[-min(MAX_MATCH, n) * _WIDTH :])
        own = _best_draft(ctx.packed, tail, max(0, n - 1 - WINDOW), n - 1, limit)
        store = self.outputs.get(ctx.tenant)
        if store is None or own.score >= limit:  # nothing could score higher
            return own
        theirs = _best_draft(store, tail, 0, len(store) // _WIDTH, limit)
        return theirs if theirs.score > own.score else own

    def _context(self, request: Request) -> _Context:
        """The request's tokens packed, brought up to date (started over after a preemption)."""
        ctx = self._contexts.get(request.request_id)
        prompt, outputs = request.prompt_token_ids, request.output_token_ids
        if ctx is None or len(ctx.packed) // _WIDTH > request.num_tokens:
            ctx = _Context(bytearray(array("q", prompt).tobytes()), request.cache_salt, len(prompt))
            self._contexts[request.request_id] = ctx
        have = len(ctx.packed) // _WIDTH - len(prompt)
        if have < len(outputs):
            ctx.packed += array("q", outputs[have:]).tobytes()
        return ctx

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        """The request's output joins its tenant's store."""
        ctx = self._contexts.pop(request_id, None)
        if ctx is None:
            return
        output = memoryview(ctx.packed)[ctx.num_prompt_tokens * _WIDTH :].cast("q")
        with output:
            self.outputs.add(ctx.tenant, output.tolist())


def _best_draft(store: bytearray, tail: bytes, lo: int, hi: int, max_tokens: int) -> SuffixDraft:
    """The best-scoring draft from the occurrences of `tail`'s end in `store`'s tokens
    [lo, hi) (an occurrence's continuation may run past `hi`, up to the store's end)."""
    k_tail = len(tail) // _WIDTH
    found: dict[int, int] = {}
    """Continuation start -> match length."""
    for key, limit in ((MIN_MATCH, MAX_OCCURRENCES), (LONG_KEY, LONG_OCCURRENCES)):
        if key > k_tail:
            break
        for start in _occurrences(store, tail[-key * _WIDTH :], lo, hi, limit):
            if start not in found:
                found[start] = _match_length(store, tail, start, key)
    if not found:
        return SuffixDraft()
    size = len(store) // _WIDTH
    with memoryview(store).cast("q") as tokens:
        runs = {
            start: (match, tokens[start : min(start + max_tokens, size)].tolist())
            for start, match in found.items()
        }
    best = SuffixDraft()
    longest = max(found.values())
    for m in sorted({longest, *(t for t in MATCH_THRESHOLDS if t < longest)}, reverse=True):
        voters = [run for match, run in runs.values() if match >= m]
        draft = _vote(voters, min(max_tokens, int(SPEC_FACTOR * m)), m)
        if draft.score > best.score:
            best = draft
    return best


def _vote(runs: list[list[int]], max_tokens: int, match: int) -> SuffixDraft:
    """The majority continuation of `runs` (see the module docstring). Identical runs vote as
    one with their count (a store of repeated outputs holds many), and once the voters left
    agree to the end, the rest of the draft is theirs with the estimate unchanged."""
    live = Counter(map(tuple, runs))
    """Each distinct run still voting, and how many occurrences continue so."""
    num_voters = len(runs)
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    for j in range(max_tokens):
        if len(live) == 1:  # every voter left continues alike: each share is 1
            (run,) = live
            rest = run[j:max_tokens]
            end = rest.index(_SEPARATOR) if _SEPARATOR in rest else len(rest)
            tokens.extend(rest[:end])
            probs.extend([prob] * end)
            break
        counts: Counter[int] = Counter()
        for run, weight in live.items():
            if len(run) > j and run[j] != _SEPARATOR:
                counts[run[j]] += weight
        if not counts:
            break
        token, count = counts.most_common(1)[0]
        prob *= count / num_voters
        if prob < MIN_TOKEN_PROB:
            break
        tokens.append(token)
        probs.append(prob)
        live = Counter({run: w for run, w in live.items() if len(run) > j and run[j] == token})
        num_voters = count
    return SuffixDraft(tuple(tokens), tuple(probs), match)


def _occurrences(store: bytearray, needle: bytes, lo: int, hi: int, limit: int) -> list[int]:
    """The token index just after each whole-token occurrence of `needle` that ends by token
    `hi` and starts at or after token `lo`, latest first, at most `limit` of them."""
    found: list[int] = []
    lo_byte, end = lo * _WIDTH, hi * _WIDTH
    while len(found) < limit:
        at = store.rfind(needle, lo_byte, end)
        if at < 0:
            break
        if at % _WIDTH == 0:
            found.append((at + len(needle)) // _WIDTH)
        end = at + len(needle) - 1  # the next one starts before this one
    return found


def _match_length(store: bytearray, tail: bytes, start: int, known: int) -> int:
    """How many of `tail`'s last tokens (at least `known`, which agree) the tokens before
    `start` in `store` agree with, by bisection (a match of m implies one of m - 1)."""
    good, bad = known, min(len(tail) // _WIDTH, start) + 1
    while bad - good > 1:
        m = (good + bad) // 2
        if store[(start - m) * _WIDTH : start * _WIDTH] == tail[-m * _WIDTH :]:
            good = m
        else:
            bad = m
    return good
