"""Hostile grammars against the compiler on SmolLM2's real vocabulary: schemas and grammars that
crash the grammar library's compiler are refused (run in a child process, where a crash of the
old code fails the test instead of killing pytest), a regex that bloats is refused and not kept,
the time budget kills the probe's child and the next grammar still compiles, refusals are
remembered, the cache is bounded in bytes, and a schema-driven fuzz target never gets anything
but a grammar or a 400."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.environment import default_model_path
from deepinfer.errors import InvalidRequestError
from deepinfer.model.loading.gguf_loader import open_gguf
from deepinfer.request import StructuredKind, StructuredSpec
from deepinfer.sampling.constraints import CompilerLimits, ConstraintCompiler
from deepinfer.sampling.vocabulary import vocabulary_from
from deepinfer.text.tokenizer import Tokenizer


def ref_chain(depth: int, via: str) -> str:
    """A schema whose definitions chain `depth` deep through `via` (what a ~100 KB body holds)."""

    def link(i: int) -> dict[str, Any]:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        if via == "properties":
            return {"type": "object", "properties": {"a": ref}}
        if via == "items":
            return {"type": "array", "items": ref}
        return {via: [ref, {"type": "null"}]}

    defs = {f"d{i}": link(i) for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def rule_chain(depth: int) -> str:
    """A lark grammar of one rule chain `depth` long."""
    rules = "\n".join(f"r{i}: r{i + 1}" for i in range(depth))
    return f'start: r0\n{rules}\nr{depth}: "x"'


CRASHERS = [
    ("json_schema", ref_chain(1000, "properties")),
    ("json_schema", ref_chain(3000, "anyOf")),
    ("json_schema", ref_chain(3000, "allOf")),
    ("json_schema", ref_chain(3000, "items")),
    ("grammar", rule_chain(15000)),
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(default_model_path()))


@pytest.fixture
def compiler(tokenizer: Tokenizer) -> Any:
    compiler = ConstraintCompiler(lambda: vocabulary_from(tokenizer, 2))
    yield compiler
    compiler.check_integrity()
    compiler.close()


@pytest.mark.slow
def test_crashers_are_refused_or_compiled_never_crash() -> None:
    """Each crasher stays under 256 KiB; in a child process, the compiler answers each with a
    grammar or a 400 and then still compiles a plain schema."""
    assert all(len(source) < 256 << 10 for _, source in CRASHERS)
    script = textwrap.dedent(
        """
        import json, sys
        from deepinfer.environment import default_model_path
        from deepinfer.errors import InvalidRequestError
        from deepinfer.model.loading.gguf_loader import open_gguf
        from deepinfer.request import StructuredKind, StructuredSpec
        from deepinfer.sampling.constraints import ConstraintCompiler
        from deepinfer.sampling.vocabulary import vocabulary_from
        from deepinfer.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(open_gguf(default_model_path()))
        compiler = ConstraintCompiler(lambda: vocabulary_from(tokenizer, 2))
        crashers = json.loads(sys.stdin.read())
        crashers.append(["json_schema", '{"type": "integer"}'])
        for kind, source in crashers:
            try:
                compiler.compile(StructuredSpec(StructuredKind(kind), source, "field"))
                print("compiled", flush=True)
            except InvalidRequestError as exc:
                print("refused", str(exc)[:200].replace("\\n", " "), flush=True)
        compiler.close()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(CRASHERS),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert len(lines) == len(CRASHERS) + 1, lines
    assert lines[-1] == "compiled"
    refused = [line for line in lines if line.startswith("refused")]
    assert refused, lines  # the deepest chains do crash the library in its child
    assert all("field: the " in line for line in refused)


@pytest.mark.slow
def test_a_refused_crash_is_remembered(compiler: ConstraintCompiler) -> None:
    spec = StructuredSpec(StructuredKind.GRAMMAR, rule_chain(15000), "structured_outputs.grammar")
    with pytest.raises(InvalidRequestError, match="crashed the grammar compiler") as info:
        compiler.compile(spec)
    assert info.value.param == "structured_outputs.grammar"
    assert compiler.probe.num_crashes == 1
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match="crashed"):
        compiler.compile(spec)
    assert time.monotonic() - started < 0.5 and compiler.probe.num_crashes == 1
    compiler.compile(StructuredSpec(StructuredKind.REGEX, "[a-c]{3}", "guided_regex"))


@pytest.mark.slow
def test_a_regex_that_bloats_is_refused_and_not_kept(compiler: ConstraintCompiler) -> None:
    """35 bytes that once held ~150 MB in the cache: the library gives up on its lexer in the
    probe, so nothing of it is built in the server."""
    spec = StructuredSpec(StructuredKind.REGEX, "(x{1000}){1001}", "guided_regex")
    with pytest.raises(InvalidRequestError, match="too complex"):
        compiler.compile(spec)
    assert compiler.cached_bytes == 0
    with pytest.raises(InvalidRequestError, match="too complex"):
        compiler.compile(spec)


@pytest.mark.slow
def test_the_time_budget_kills_the_child_and_the_next_grammar_compiles(
    tokenizer: Tokenizer,
) -> None:
    limits = CompilerLimits(compile_timeout_s=0.05)
    compiler = ConstraintCompiler(lambda: vocabulary_from(tokenizer, 2), limits)
    compiler.compile(StructuredSpec(StructuredKind.REGEX, "warm", "x"))  # the child is up
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match=r"longer than 0.05 s"):  # it takes ~1 s
        compiler.compile(StructuredSpec(StructuredKind.REGEX, "(x{1000}){1001}", "guided_regex"))
    assert time.monotonic() - started < 5.0
    assert compiler.probe.num_timeouts == 1
    compiler.compile(StructuredSpec(StructuredKind.REGEX, "[0-9]+", "x"))
    compiler.check_integrity()
    compiler.close()


@pytest.mark.slow
def test_the_cache_is_bounded_in_bytes(tokenizer: Tokenizer) -> None:
    big = [StructuredSpec(StructuredKind.REGEX, f"(x{{100}}){{{n}}}", "x") for n in (90, 95, 101)]
    probe = ConstraintCompiler(lambda: vocabulary_from(tokenizer, 2))
    sizes = [probe.probe.check(spec.kind, spec.source).num_bytes for spec in big]
    probe.close()
    assert min(sizes) > 1 << 20  # measured, not guessed from the text's 14 bytes
    bound = sizes[1] + sizes[2] + (1 << 20)
    limits = CompilerLimits(max_cached_bytes=bound)
    compiler = ConstraintCompiler(lambda: vocabulary_from(tokenizer, 2), limits)
    for spec in big:
        compiler.compile(spec)
        compiler.check_integrity()
        assert compiler.cached_bytes <= bound
    cached = {spec.source for spec in big if compiler._lookup(_key(spec), spec) is not None}
    assert cached == {big[1].source, big[2].source}  # the least recently used went first
    compiler.matcher(big[0])  # evicted: built again for a request that needs it
    compiler.close()


def _key(spec: StructuredSpec) -> bytes:
    from deepinfer.sampling.constraints import _key as key

    return key(spec)


# ---- the fuzz target


_LEAVES = st.sampled_from(
    [
        {"type": "string"},
        {"type": "integer", "minimum": -5, "maximum": 99},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "string", "pattern": "[a-z]{2,12}(-[0-9]+)?"},
        {"type": "string", "pattern": "(a|b)*c{3,40}"},
        {"type": "string", "format": "date-time"},
        {"type": "string", "maxLength": 20},
        {"enum": ["a", "b", 3]},
        {"const": "x"},
        {"$ref": "#/$defs/node"},
    ]
)


def _nest(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.text("abcdefgh", min_size=1, max_size=4)
    return st.one_of(
        st.dictionaries(keys, children, min_size=1, max_size=6).map(
            lambda props: {"type": "object", "properties": props, "required": list(props)[:1]}
        ),
        children.map(lambda item: {"type": "array", "items": item, "maxItems": 5}),
        st.lists(children, min_size=1, max_size=4).map(lambda options: {"anyOf": options}),
        st.lists(children, min_size=1, max_size=3).map(lambda options: {"oneOf": options}),
        st.lists(children, min_size=1, max_size=2).map(lambda parts: {"allOf": parts}),
    )


SCHEMAS = st.recursive(_LEAVES, _nest, max_leaves=40).map(
    lambda root: (
        {
            **root,
            "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
        }
        if isinstance(root, dict)
        else root
    )
)


@pytest.mark.slow
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=SCHEMAS, depth=st.integers(0, 2500))
def test_fuzzed_schemas_compile_or_are_refused(
    compiler: ConstraintCompiler, schema: dict[str, Any], depth: int
) -> None:
    """Depth, width, references (recursive too) and regex features, with a reference chain of
    up to 2,500 links beside them: a grammar or a 400, never a crash (the probe's child takes
    those), and the compiler's books stay straight."""
    if depth:
        chain = json.loads(ref_chain(depth, "anyOf"))
        schema = {"type": "object", "properties": {"shape": schema, "chain": chain["$defs"]["d0"]}}
        schema["$defs"] = {**chain["$defs"], "node": {"type": "object"}}
    spec = StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(schema), "response_format")
    try:
        compiler.compile(spec)
    except InvalidRequestError as exc:
        assert exc.param == "response_format"
        assert str(exc).startswith("response_format: the json_schema ")
    compiler.check_integrity()
