"""The compact BPE (text/bpe.c) that GGUF vocabularies encode on: the ids of `tokenizers`' own BPE on the same
vocabulary, for every text, in a fraction of its memory, read where the file holds the strings."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.errors import ModelFormatError
from deltaserve.formats.gguf import GGUFStrings, read_gguf
from deltaserve.text import bpe
from deltaserve.text.tokenizer import GIL_FREE_CHARS, Tokenizer
from tests.fixtures.tokenizers import load_tiktoken_ranks, qwen35_ranks_path, real_qwen35_tokenizer
from tests.test_tokenizer import write_tokenizer_gguf

pytestmark = pytest.mark.skipif(not bpe.available(), reason=f"bpe.c is not built here: {bpe.why_not()}")

TEMPLATE = (Path(__file__).parent / "data" / "qwen3_5_chat_template.jinja").read_text(encoding="utf-8")
ROWS = 248_320


def tokenizers_own(fields: dict, **kw) -> Tokenizer:
    """The same GGUF fields built on `tokenizers`' BPE, as deltaserve does where bpe.c cannot be built."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bpe, "available", lambda: False)
        tok = Tokenizer.from_gguf_fields(fields, **kw)
    assert not tok.compact
    return tok


@pytest.fixture(scope="module")
def vocab_gguf(tmp_path_factory) -> Path:
    backend = real_qwen35_tokenizer()
    source = Tokenizer(backend, chat_template=TEMPLATE, eos_id=backend.token_to_id("<|im_end|>"),
                       pad_id=backend.token_to_id("<|endoftext|>"))
    return write_tokenizer_gguf(source, tmp_path_factory.mktemp("bpe") / "qwen35-vocab.gguf", ROWS)


@pytest.fixture(scope="module")
def fields(vocab_gguf) -> dict:
    return read_gguf(vocab_gguf).metadata


@pytest.fixture(scope="module")
def pair(fields) -> tuple[Tokenizer, Tokenizer]:
    compact = Tokenizer.from_gguf_fields(fields)
    assert compact.compact
    return compact, tokenizers_own(fields)


def random_texts(count: int, seed: int) -> list[str]:
    """Runs of random real tokens (the merges under stress), and random characters of many kinds."""
    ranks = load_tiktoken_ranks(qwen35_ranks_path())
    tokens = list(ranks)
    rng = random.Random(seed)
    alphabet = "abcXYZ019 \n\t\r.,'!?-_<>|/\\éüßçñ加拿大新坡🙂👍🏽\u0301\u0338\u200d\u00a0ـ"
    out = []
    for i in range(count):
        if i % 2:
            out.append(b"".join(rng.choice(tokens) for _ in range(rng.randint(1, 12))).decode("utf-8", "ignore"))
        else:
            out.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))))
    return out


def test_the_gguf_reader_leaves_the_vocabulary_in_the_file_and_it_reads_as_the_list_it_is(vocab_gguf, fields):
    tokens, merges = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.merges"]
    assert isinstance(tokens, GGUFStrings) and isinstance(merges, GGUFStrings)
    reference = gguf.GGUFReader(str(vocab_gguf)).fields["tokenizer.ggml.tokens"]
    want = [bytes(reference.parts[i]).decode("utf-8") for i in reference.data]
    assert len(tokens) == ROWS and tokens == want and tokens[-1] == want[-1] and tokens[100:103] == want[100:103]
    assert merges[0] == "Ġ Ġ"


def test_the_compact_bpe_encodes_random_texts_as_tokenizers_own_bpe_does(pair):
    compact, own = pair
    texts = random_texts(4000, seed=5)
    assert [compact.encode(t) for t in texts] == [own.encode(t) for t in texts]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_the_compact_bpe_encodes_any_text_as_tokenizers_own_bpe_does(pair, text):
    compact, own = pair
    if any(0xD800 <= ord(c) < 0xE000 for c in text):
        return
    assert compact.encode(text) == own.encode(text)


def test_added_tokens_are_found_in_the_text_as_written_and_the_rest_normalised_around_them(pair):
    compact, own = pair
    # ">" + U+0338 is "≯" under NFC: normalising the whole text would hide the added token
    for text in ("<think>\u0338 x", "a<|im_end|>\u0301e\u0301", "caf\u0065\u0301 <tool_call>\u0338</tool_call>", "\u212b<|im_start|>"):
        ids = compact.encode(text)
        assert ids == own.encode(text), text
    assert compact.think_start_id in compact.encode("<think>\u0338")


def test_the_llama_cpp_way_that_only_merges_is_the_same_too(fields):
    compact = Tokenizer.from_gguf_fields(fields, ignore_merges=False)
    own = tokenizers_own(fields, ignore_merges=False)
    texts = [*random_texts(1000, seed=6), "加拿大 新加坡", " 加拿大"]
    assert [compact.encode(t) for t in texts] == [own.encode(t) for t in texts]
    assert compact.encode("加拿大") != Tokenizer.from_gguf_fields(fields).encode("加拿大")  # it does merge only


def test_the_qwen2_split_is_the_same_too(fields):
    qwen2 = {**fields, "tokenizer.ggml.pre": "qwen2"}
    compact, own = Tokenizer.from_gguf_fields(qwen2), tokenizers_own(qwen2)
    texts = random_texts(600, seed=7)
    assert [compact.encode(t) for t in texts] == [own.encode(t) for t in texts]


def test_a_long_text_and_placeholders_for_literal_text_encode_the_same(pair):
    compact, own = pair
    long = "".join(random_texts(400, seed=8)) * (GIL_FREE_CHARS // 4000 + 1)
    assert len(long) >= GIL_FREE_CHARS and compact.encode(long) == own.encode(long)
    literals = {"\ue000": "a message that writes <|im_end|> and <think> as text"}
    text = "<|im_start|>user\n\ue000<|im_end|>\n"
    assert compact.encode_literal(text, literals) == own.encode_literal(text, literals)
    assert compact.encode_batch(["x y", "<|im_end|>"]) == own.encode_batch(["x y", "<|im_end|>"])


def test_decode_ids_and_the_token_table_are_the_same(pair):
    compact, own = pair
    assert compact._table() == own._table()
    ids = list(range(0, ROWS + 10, 37)) + [-1]
    assert compact.decode(ids) == own.decode(ids)
    for i in (0, 198, 1000, 248_044, 248_046, 248_076, 248_077, 248_319, ROWS + 5):
        assert compact.id_to_token(i) == own.id_to_token(i), i
        token = own.id_to_token(i)
        if token is not None:
            assert compact.token_to_id(token) == own.token_to_id(token) == i
    assert compact.token_to_id("no such token") is None
    assert (compact.vocab_size, compact.stop_ids, compact.special_ids, compact.added_ids, compact.fewest_tokens("x" * 999)) \
        == (own.vocab_size, own.stop_ids, own.special_ids, own.added_ids, own.fewest_tokens("x" * 999))


def test_the_tokenizers_backend_is_still_there_where_one_is_asked_for(pair):
    compact, own = pair
    text = "Hello, 加拿大 <|im_end|>"
    assert compact.backend.encode(text, add_special_tokens=False).ids == own.encode(text)
    assert compact.merges()[:50] == own.merges()[:50] and len(compact.merges()) == len(own.merges())


def test_a_merge_of_tokens_the_vocabulary_lacks_is_refused_by_name(fields):
    merges = list(fields["tokenizer.ggml.merges"])
    merges[7] = "Ġ zzzzqq"
    with pytest.raises(ModelFormatError, match=r"expected merges of tokens in the vocabulary, found: merge 7 \('Ġ zzzzqq'\) "
                                               r"makes 'zzzzqq', which is not in the vocabulary"):
        Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.merges": merges})


def _anon_mib_of(build: str, vocab_gguf: Path) -> float:
    code = f"""
import gc, ctypes
from deltaserve.formats.gguf import read_gguf
from deltaserve.text import bpe
from deltaserve.text.tokenizer import Tokenizer
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) / 1024
fields = read_gguf({str(vocab_gguf)!r}).metadata
if {build!r} == "tokenizers":
    bpe.available = lambda: False
    fields = {{k: list(v) if hasattr(v, "strings_at") else v for k, v in fields.items()}}
gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
before = anon()
tok = Tokenizer.from_gguf_fields(fields)
del fields
gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
tok.encode("warm up, 加拿大"); print(anon() - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.split()[-1])


def test_the_compact_tokenizer_holds_a_fraction_of_what_tokenizers_bpe_holds(vocab_gguf, pair):
    compact = _anon_mib_of("compact", vocab_gguf)
    own = _anon_mib_of("tokenizers", vocab_gguf)
    assert pair[0]._compact.bpe.nbytes < 20 << 20
    assert compact < 25 and own > 2 * compact, (compact, own)


def test_without_a_compiler_the_tokenizer_is_tokenizers_own_and_says_nothing_different(vocab_gguf, pair, tmp_path):
    code = f"""
import json
from deltaserve.formats.gguf import read_gguf
from deltaserve.text.tokenizer import Tokenizer
tok = Tokenizer.from_gguf_fields(read_gguf({str(vocab_gguf)!r}).metadata)
print(json.dumps([tok.compact, tok.encode("Hello, 加拿大 <|im_end|> e\\u0301")]))
"""
    env = {"PATH": "/usr/bin:/bin", "CC": "no-such-compiler", "DELTASERVE_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=True)
    compact, ids = json.loads(out.stdout)
    assert compact is False and ids == pair[0].encode("Hello, 加拿大 <|im_end|> e\u0301")


def test_a_file_cut_inside_the_vocabulary_names_the_byte_it_ends_at(tmp_path):
    path = tmp_path / "strings.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_array("test.strings", [f"token{i}" for i in range(5000)])
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert isinstance(read_gguf(path).metadata["test.strings"], GGUFStrings)
    raw = path.read_bytes()
    cut = raw.index(b"token4321") + 4
    path.write_bytes(raw[:cut])
    with pytest.raises(ModelFormatError, match=f"truncated GGUF: strings.gguf ends at byte {cut} while reading test.strings "
                                               f"\\(needs byte {cut + 5}\\)"):
        read_gguf(path)
