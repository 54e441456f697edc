"""IncrementalDetokenizer: unicode across tokens, stop strings across token boundaries, streaming."""

import pytest

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.request import SamplingParams


@pytest.fixture(scope="module")
def tok(smollm2_source):
    from kiln.loader import load_tokenizer

    return load_tokenizer(smollm2_source.model_dir)


TEXTS = [
    "Hello 世界 ☃ café 🙂  two  spaces\nnew line\ttab",
    "Ünïcödé: 日本語のテキスト, emoji 👩‍👩‍👧 and ∑ maths",
    "plain ascii text with punctuation!?",
]


def stream(tok, ids, params, prompt=(), chunk=1):
    d = IncrementalDetokenizer(tok, list(prompt), params)
    deltas = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        deltas.append(d.add(ids[i:i + chunk], finished=last))
    return d, deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streaming_deltas_equal_full_decode(tok, text, chunk):
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas = stream(tok, ids, SamplingParams(), prompt=tok.encode("Say:"), chunk=chunk)
    assert "".join(deltas) == d.text == tok.decode(ids, skip_special_tokens=True)
    # No delta ever carries a half character.
    assert all("\ufffd" not in x for x in deltas)


def test_multibyte_character_waits_for_all_bytes(tok):
    ids = tok.encode("世", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character split over tokens"
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    assert d.add(ids[:-1]) == ""
    assert d.add(ids[-1:]) == "世"


def test_skip_special_tokens(tok):
    eos = tok.eos_token_id
    ids = tok.encode("hi", add_special_tokens=False) + [eos]
    d, deltas = stream(tok, ids, SamplingParams())
    assert "".join(deltas) == "hi"
    d, deltas = stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "hi" + tok.eos_token


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_across_tokens(tok, include, chunk):
    text = "The answer is 42. STOP here and more text after"
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["STOP here"], include_stop_str_in_output=include)
    d = IncrementalDetokenizer(tok, [], params)
    out = ""
    for i in range(0, len(ids), chunk):
        out += d.add(ids[i:i + chunk])
        # Never a fragment of the stop string while it is not complete.
        if not d.stopped:
            assert not out.endswith(("S", "ST", "STO", "STOP", "STOP ", "STOP h"))
        if d.stopped:
            break
    expected = "The answer is 42. " + ("STOP here" if include else "")
    assert d.stopped and d.matched_stop == "STOP here"
    assert out == d.text == expected
    # Tokens after the one that completed the stop string are not consumed.
    assert tok.decode(d.token_ids).endswith("here")
    assert d.add(tok.encode(" more", add_special_tokens=False)) == ""


def test_earliest_stop_wins_and_unmatched_prefix_is_released(tok):
    params = SamplingParams(stop=["world", "lo w"])
    ids = tok.encode("hello world", add_special_tokens=False)
    d, deltas = stream(tok, ids, params)
    assert d.matched_stop == "lo w" and "".join(deltas) == "hel"
    # A held-back partial match is released when the sequence finishes without stopping.
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["wor!"]))
    assert d.add(tok.encode("hello wor", add_special_tokens=False)) == "hello "
    assert d.add([], finished=True) == "wor"
    assert not d.stopped


def test_stop_string_with_unicode(tok):
    ids = tok.encode("数学: ∑ 世界 end", add_special_tokens=False)
    d, deltas = stream(tok, ids, SamplingParams(stop=["世界"]))
    assert "".join(deltas) == d.text == "数学: ∑ " and d.stopped


def test_hidden_stop_token(tok):
    ids = tok.encode("abc", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    assert d.add(ids[:-1]) + d.add(ids[-1:], finished=True, hidden=[7]) == "abc"
    assert d.token_ids == ids + [7]


@pytest.mark.parametrize("skip_special", [True, False])
def test_rust_decoder_gives_transformers_text(tok, skip_special):
    """The detokenizer calls a fast tokenizer's Rust decoder directly; on random id streams (special
    tokens and split multi-byte characters included) every delta equals transformers' decode path."""
    import random

    from kiln.engine.detokenizer import _fast_decode_ok

    assert _fast_decode_ok(tok)
    rng = random.Random(0)
    specials = sorted(tok.all_special_ids)
    utf8 = tok.encode("日本語 👩‍👩‍👧 ∑ café", add_special_tokens=False)
    for trial in range(20):
        ids = [rng.choice(specials) if rng.random() < 0.05 else rng.choice(utf8) if rng.random() < 0.3
               else rng.randrange(tok.vocab_size) for _ in range(60)]
        params = SamplingParams(skip_special_tokens=skip_special, stop=["ab"] if trial % 2 else [])
        fast, fast_deltas = stream(tok, ids, params, prompt=[5, 6, 7], chunk=1 + trial % 3)
        assert fast._backend is not None

        class Plain:  # the same tokenizer without the Rust shortcut
            def decode(self, *a, **k):
                return tok.decode(*a, **k)

        slow = IncrementalDetokenizer(Plain(), [5, 6, 7], params)
        assert slow._backend is None
        slow_deltas = [slow.add(ids[i:i + 1 + trial % 3], finished=i + 1 + trial % 3 >= len(ids))
                       for i in range(0, len(ids), 1 + trial % 3)]
        assert fast_deltas == slow_deltas and fast.text == slow.text and fast.token_ids == slow.token_ids


@pytest.mark.parametrize("method", ["decode", "_decode"])
def test_a_tokenizer_with_its_own_decode_keeps_it(tok, method):
    from kiln.engine.detokenizer import _fast_decode_ok

    base = getattr(type(tok), method)
    Custom = type("Custom", (type(tok),), {method: lambda self, *a, **k: base(self, *a, **k).upper()})
    custom = Custom.__new__(Custom)
    custom.__dict__.update(tok.__dict__)
    assert not _fast_decode_ok(custom)
    d = IncrementalDetokenizer(custom, [], SamplingParams())
    assert d._backend is None and d.add(tok.encode("hello", add_special_tokens=False), finished=True) == "HELLO"


class ReferenceDetokenizer:
    """The detokenizer as first written (one growing text string, every decode through
    transformers), kept as the readable reference the faster one must match delta for delta."""

    def __init__(self, tokenizer, prompt_ids, params):
        self.tokenizer, self.skip = tokenizer, params.skip_special_tokens
        self.stop = [s for s in params.stop if s]
        self.include_stop = params.include_stop_str_in_output
        self.ids = list(prompt_ids[-5:])
        self.prefix, self.read = 0, len(self.ids)
        self.text, self.emitted, self.token_ids = "", 0, []
        self.stopped, self.matched_stop = False, None

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def window(self, force):
        prefix, full = self.decode(self.ids[self.prefix:self.read]), self.decode(self.ids[self.prefix:])
        if force or (len(full) > len(prefix) and (not full.endswith("\ufffd") or len(self.ids) - self.read >= 6)):
            self.prefix, self.read = self.read, len(self.ids)
            return full[len(prefix):]
        return ""

    def append(self, delta):
        old = len(self.text)
        self.text += delta
        hits = [(self.text.find(s, max(0, old - len(s) + 1)), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if delta and hits:
            i, s = min(hits, key=lambda h: h[0])  # the first listed stop wins a tie
            self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
            self.stopped, self.matched_stop = True, s

    def add(self, token_ids, finished=False, hidden=()):
        for t in token_ids:
            if self.stopped:
                break
            self.token_ids.append(t)
            self.ids.append(t)
            self.append(self.window(force=False))
        if not self.stopped:
            self.token_ids.extend(hidden)
            if finished and self.read < len(self.ids):
                self.append(self.window(force=True))
        hold = 0
        if not (finished or self.stopped):
            for s in self.stop:
                hold = max([hold] + [k for k in range(1, len(s)) if self.text.endswith(s[:k])])
        end = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta


def test_matches_the_reference_on_random_streams(tok):
    """Deltas, text, consumed tokens and the matched stop equal the reference's on random streams:
    split multi-byte characters, special tokens, stop strings that occur (one of them inside
    another, some spanning tokens), that almost occur, and chunks of 1-4 tokens with hidden ids."""
    import random

    rng = random.Random(1)
    utf8 = tok.encode("日本語 👩‍👩‍👧 ∑ café the theme then", add_special_tokens=False)
    specials = sorted(tok.all_special_ids)
    for trial in range(400):
        ids = [rng.choice(specials) if rng.random() < 0.03 else rng.choice(utf8) if rng.random() < 0.5
               else rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 80))]
        text = tok.decode(ids)
        stops = []
        for _ in range(rng.randrange(0, 4)):
            i = rng.randrange(len(text) + 1)
            s = text[i:i + rng.randrange(1, 7)]
            stops.append(s + "\x00" if rng.random() < 0.3 else s)  # the second kind never completes
            if len(s) > 1 and rng.random() < 0.3:  # two stops matching at the same place
                stops.insert(rng.randrange(len(stops) + 1), s[:-1])
        params = SamplingParams(stop=stops, include_stop_str_in_output=rng.random() < 0.5,
                                skip_special_tokens=rng.random() < 0.7)
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        fast, ref = IncrementalDetokenizer(tok, prompt, params), ReferenceDetokenizer(tok, prompt, params)
        i = 0
        while i < len(ids):
            n = rng.randrange(1, 5)
            last = i + n >= len(ids)
            hidden = [7] if last and rng.random() < 0.3 else []
            got, want = fast.add(ids[i:i + n], last, hidden), ref.add(ids[i:i + n], last, hidden)
            assert got == want, (trial, i, stops)
            i += n
        assert (fast.text, fast.token_ids, fast.stopped, fast.matched_stop) == \
            (ref.text, ref.token_ids, ref.stopped, ref.matched_stop), (trial, stops)


def test_deferred_text_equals_the_stream_on_random_streams(tok):
    """A sequence nobody streams (`defer`) decodes once at the end: no text before it finishes,
    then exactly the text (and token ids) the incremental windows give, on random streams with
    split multi-byte characters, invalid bytes, special tokens and hidden ids."""
    import random

    rng = random.Random(2)
    utf8 = tok.encode("日本語 👩‍👩‍👧 ∑ café the theme then", add_special_tokens=False)
    specials = sorted(tok.all_special_ids)
    replaced = 0
    for trial in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.03 else rng.choice(utf8) if rng.random() < 0.5
               else rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 80))]
        params = SamplingParams(skip_special_tokens=rng.random() < 0.7)
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        deferred, ref = IncrementalDetokenizer(tok, prompt, params, defer=True), ReferenceDetokenizer(tok, prompt, params)
        assert deferred.defer
        i, got, want = 0, [], []
        while i < len(ids):
            n = rng.randrange(1, 5)
            last = i + n >= len(ids)
            hidden = [7] if last and rng.random() < 0.3 else []
            got.append(deferred.add(ids[i:i + n], last, hidden))
            want.append(ref.add(ids[i:i + n], last, hidden))
            i += n
        assert all(g == "" for g in got[:-1]), trial
        assert got[-1] == "".join(want) == ref.text == deferred.text, trial
        assert deferred.token_ids == ref.token_ids, trial
        replaced += "\ufffd" in ref.text
    assert replaced > 10, "no stream had replacement characters"


def test_deferred_text_joins_a_character_split_by_skipped_tokens(tok):
    """The one difference (module docstring): a character whose bytes are split by 6 tokens that
    decode to nothing. A stream has shown replacement characters; the deferred text is the decode."""
    ids = tok.encode("世", add_special_tokens=False)
    split = ids[:1] + [tok.eos_token_id] * 6 + ids[1:]
    streamed = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas = [streamed.add([t]) for t in split[:-1]] + [streamed.add(split[-1:], finished=True)]
    assert "\ufffd" in "".join(deltas)
    deferred = IncrementalDetokenizer(tok, [], SamplingParams(), defer=True)
    assert deferred.add(split, finished=True) == "世" == tok.decode(split, skip_special_tokens=True)


def test_stop_strings_are_never_deferred(tok):
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["x"]), defer=True)
    assert not d.defer
    ids = tok.encode("a b x c", add_special_tokens=False)
    assert d.add(ids, finished=True) == "a b " and d.matched_stop == "x"
