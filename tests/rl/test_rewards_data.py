"""kiln.rl.rewards and kiln.rl.data: answer extraction, reward loading, prompt files, the arithmetic
task and resumable prompt iteration."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from kiln.rl.data import ArithmeticTask, PromptIterator, load_jsonl_prompts
from kiln.rl.rewards import REWARDS, RewardFn, extract_final_number, load_reward_fn, math_reward


@pytest.mark.parametrize(
    "text, expect",
    [
        ("The answer is 42.", "42"),
        ("42", "42"),
        ("First 3 apples, then 7 more: 10 apples in total.", "10"),
        (r"so the result is \boxed{-3.5}", "-3.5"),
        (r"\boxed{-3.5} and then some text 99", "-3.5"),
        (r"wrong \boxed{1} then fixed \boxed{2}", "2"),
        (r"$\boxed{\frac{3}{4}}$", "3/4"),
        (r"\boxed{\dfrac{-1}{2}}", "-1/2"),
        (r"\boxed{x = 12}", "12"),
        (r"\boxed{1,000}", "1000"),
        ("Natalia sold 48/2 = 24 clips.\n#### 1,234", "1234"),
        ("#### 72\nthen rambling 5", "72"),
        ("#### -8", "-8"),
        ("3/4", "3/4"),
        ("It costs $1,234.56.", "1234.56"),
        ("x = -7", "-7"),
        ("x=-7", "-7"),
        ("answer: \u22127", "-7"),  # unicode minus
        ("17 - 25", "25"),  # subtraction, not a negative number
        ("5-3", "3"),
        ("We get 1, 2, 3", "3"),
        ("about .5 of it", ".5"),
        ("3.14159", "3.14159"),
        ("no number here", None),
        ("", None),
        (r"\boxed{}", None),
    ],
)
def test_extract_final_number(text, expect):
    assert extract_final_number(text) == expect


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("The answer is 42.", "42", 1.0),
        ("The answer is 42.", 42, 1.0),
        ("The answer is 42.0", "42", 1.0),
        ("The answer is 41.", "42", 0.0),
        (r"\boxed{-3.5}", "-7/2", 1.0),
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
        ("3/4", "0.75", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("1234", "1,234", 1.0),
        ("She has 18 left.", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18\n#### 18", 1.0),  # GSM8K solution
        ("0.333331", "1/3", 0.0),  # 2.3e-6 off: beyond 1e-6
        ("0.3333333", "1/3", 1.0),  # 3.3e-8 off: within 1e-6
        ("no number", "0", 0.0),
        ("I don't know", "42", 0.0),
        ("1/0", "1", 0.0),
        ("7", "not a number", 0.0),
    ],
)
def test_math_reward(completion, answer, reward):
    assert math_reward(completion, answer) == reward


def test_builtin_math_reward_fn():
    fn = REWARDS["math"]
    assert isinstance(fn, RewardFn)
    assert fn("What is 2 + 2?", "It is 4.", {"prompt": "What is 2 + 2?", "answer": "4"}) == 1.0
    assert fn("What is 2 + 2?", "It is 5.", {"prompt": "What is 2 + 2?", "answer": "4"}) == 0.0
    with pytest.raises(KeyError, match="answer"):
        fn("p", "4", {"prompt": "p"})
    assert load_reward_fn("math") is fn


def test_load_reward_fn_from_module(tmp_path, monkeypatch):
    pkg = tmp_path / "kiln_test_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(
        textwrap.dedent(
            """
            def length_reward(prompt, completion, sample):
                return float(len(completion))
            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        fn = load_reward_fn("kiln_test_rewards_pkg.scoring:length_reward")
        assert fn("p", "abc", {}) == 3.0
        with pytest.raises(ValueError, match="has no attribute 'missing'.*length_reward"):
            load_reward_fn("kiln_test_rewards_pkg.scoring:missing")
        with pytest.raises(ValueError, match="not callable"):
            load_reward_fn("kiln_test_rewards_pkg.scoring:NOT_CALLABLE")
    finally:
        for name in [n for n in sys.modules if n.startswith("kiln_test_rewards_pkg")]:
            del sys.modules[name]


def test_load_reward_fn_from_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def contains_yes(prompt, completion, sample):\n    return 1.0 if 'yes' in completion else 0.0\n")
    fn = load_reward_fn(f"{f}:contains_yes")
    assert fn("q", "yes indeed", {}) == 1.0 and fn("q", "no", {}) == 0.0
    with pytest.raises(ValueError, match="does not exist"):
        load_reward_fn(f"{tmp_path}/nope.py:contains_yes")


def test_load_reward_fn_passes_callables_through():
    def fn(prompt, completion, sample):
        return 0.5

    assert load_reward_fn(fn) is fn


@pytest.mark.parametrize(
    "spec, match",
    [
        ("not_a_builtin", "no ':function' part"),
        ("kiln_no_such_module_xyz:fn", "module 'kiln_no_such_module_xyz' not found"),
        ("math:", "not a function name"),
        (":fn", "missing module or file"),
        ("", "empty"),
    ],
)
def test_load_reward_fn_bad_spec_names_the_fix(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        load_reward_fn(spec)
    msg = str(e.value)
    assert "package.module:function" in msg and "path/to/file.py:function" in msg


def test_load_reward_fn_does_not_hide_a_broken_module(tmp_path, monkeypatch):
    (tmp_path / "kiln_test_broken_reward.py").write_text("import kiln_dependency_that_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="kiln_dependency_that_is_missing"):
        load_reward_fn("kiln_test_broken_reward:fn")
    sys.modules.pop("kiln_test_broken_reward", None)


# ---- data -------------------------------------------------------------------------------------


def _write(tmp_path, lines):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_load_jsonl_prompts(tmp_path):
    p = _write(
        tmp_path,
        [
            json.dumps({"prompt": "What is 1 + 1?", "answer": "2", "id": 7}),
            "",
            json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": 3}),
        ],
    )
    recs = load_jsonl_prompts(p)
    assert recs == [
        {"prompt": "What is 1 + 1?", "answer": "2", "id": 7},
        {"prompt": [{"role": "user", "content": "hi"}], "answer": 3},
    ]
    q = _write(tmp_path, [json.dumps({"question": "Q?", "solution": "#### 5"})])
    assert load_jsonl_prompts(q, prompt_key="question", answer_key="solution") == [
        {"question": "Q?", "solution": "#### 5", "prompt": "Q?", "answer": "#### 5"}
    ]
    assert load_jsonl_prompts(q, prompt_key="question", answer_key=None)[0]["prompt"] == "Q?"


def test_load_jsonl_prompts_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl_prompts(tmp_path / "nope.jsonl")
    p = _write(tmp_path, [json.dumps({"prompt": "a", "answer": "1"}), "{not json"])
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: invalid JSON"):
        load_jsonl_prompts(p)
    p = _write(tmp_path, [json.dumps({"prompt": "a", "answer": "1"}), json.dumps({"question": "b", "answer": "2"})])
    with pytest.raises(ValueError, match=r":2: missing key 'prompt'.*'question'.*--prompt-key"):
        load_jsonl_prompts(p)
    p = _write(tmp_path, [json.dumps({"prompt": "a"})])
    with pytest.raises(ValueError, match=r":1: missing key 'answer'.*--answer-key"):
        load_jsonl_prompts(p)
    p = _write(tmp_path, ["[1, 2]"])
    with pytest.raises(ValueError, match="JSON object"):
        load_jsonl_prompts(p)
    p = _write(tmp_path, [json.dumps({"prompt": 5, "answer": "1"})])
    with pytest.raises(ValueError, match="string or a list of chat messages"):
        load_jsonl_prompts(p)
    p = _write(tmp_path, [""])
    with pytest.raises(ValueError, match="no records"):
        load_jsonl_prompts(p)


def test_arithmetic_task_is_deterministic_and_correct():
    a = ArithmeticTask(seed=3).sample(200)
    assert a == ArithmeticTask(seed=3).sample(200)
    assert a != ArithmeticTask(seed=4).sample(200)
    assert len({s["prompt"] for s in a}) > 150
    seen_ops = set()
    for s in a:
        prompt = s["prompt"]
        assert prompt.startswith("What is ") and prompt.endswith("? Answer with just the number.")
        expr = prompt[len("What is ") : -len("? Answer with just the number.")]
        x, op, y = expr.split(" ")
        seen_ops.add(op)
        assert 1 <= int(x) <= 50 and 1 <= int(y) <= 50
        assert int(s["answer"]) == eval(expr)  # noqa: S307 - our own generated expression
        assert math_reward(f"The answer is {s['answer']}.", s["answer"]) == 1.0
    assert seen_ops == {"+", "-", "*"}

    # Successive calls continue the stream; state_dict resumes it.
    t = ArithmeticTask(seed=3)
    first = t.sample(5)
    state = t.state_dict()
    nxt = t.sample(5)
    assert first + nxt == ArithmeticTask(seed=3).sample(10)
    u = ArithmeticTask(seed=99)
    u.load_state_dict(json.loads(json.dumps(state)))
    assert u.sample(5) == nxt


def test_arithmetic_task_options():
    for s in ArithmeticTask(seed=0, min_operand=-5, max_operand=5, ops=("*", "+"), num_terms=4).sample(100):
        expr = s["prompt"][len("What is ") : -len("? Answer with just the number.")]
        assert int(s["answer"]) == eval(expr)  # noqa: S307 - precedence: * before +
        tokens = expr.split(" ")
        assert len(tokens) == 7 and set(tokens[1::2]) <= {"*", "+"}
        assert all(-5 <= int(t) <= 5 for t in tokens[0::2])
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(0, ops=("/",))
    with pytest.raises(ValueError, match="min_operand"):
        ArithmeticTask(0, min_operand=10, max_operand=1)
    with pytest.raises(ValueError, match="num_terms"):
        ArithmeticTask(0, num_terms=1)


def test_prompt_iterator_epochs_and_shuffles():
    prompts = list(range(10))
    it = PromptIterator(prompts, batch_size=4, seed=0)
    batches = [next(it) for _ in range(5)]  # 20 prompts = exactly 2 epochs
    assert all(len(b) == 4 for b in batches)
    flat = [x for b in batches for x in b]
    assert sorted(flat[:10]) == prompts and sorted(flat[10:]) == prompts  # each epoch is a permutation
    assert flat[:10] != flat[10:]  # reshuffled per epoch
    assert flat[:10] != prompts  # shuffled at all
    assert it.epoch == 1 and it.position == 10
    again = PromptIterator(prompts, batch_size=4, seed=0)
    assert [again.next_batch() for _ in range(5)] == batches  # deterministic given the seed
    other = PromptIterator(prompts, batch_size=4, seed=1)
    assert [next(other) for _ in range(5)] != batches
    big = PromptIterator(["a", "b", "c"], batch_size=7, seed=0)  # batch larger than the data
    assert len(next(big)) == 7
    with pytest.raises(ValueError):
        PromptIterator([], 2)
    with pytest.raises(ValueError):
        PromptIterator([1], 0)


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 7])
def test_prompt_iterator_resume_gives_the_same_next_batches(consumed):
    prompts = [{"prompt": f"p{i}", "answer": str(i)} for i in range(11)]
    it = PromptIterator(prompts, batch_size=3, seed=5)
    for _ in range(consumed):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))  # must survive a JSON checkpoint
    expect = [next(it) for _ in range(8)]  # crosses several epoch boundaries

    resumed = PromptIterator(prompts, batch_size=3, seed=123)  # seed comes from the state
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(8)] == expect
    assert resumed.state_dict() == it.state_dict()

    with pytest.raises(ValueError, match="same prompt file"):
        PromptIterator(prompts[:5], batch_size=3).load_state_dict(state)
