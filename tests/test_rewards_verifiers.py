"""Unit tests of the built-in verifiers on correct, incorrect and malformed answers."""
import pytest

from rljax.rewards import RewardResult, get_verifier
from rljax.rewards.verifiers import arith, choice, code_exec, fmt, gsm8k, majority, math_answer, overlong, similarity
from rljax.rewards.verifiers._answers import final_answer, last_boxed, to_fraction

# ---- math: (gold, completion, expected) -------------------------------------------------------

MATH_CASES = [
  # fractions vs decimals
  ("1/2", "The answer is $0.5$.", True),
  ("1/2", "\\boxed{\\frac{1}{2}}", True),
  ("1/2", "\\boxed{\\dfrac{1}{2}}", True),
  ("1/2", "\\boxed{\\tfrac{1}{2}}", True),
  ("1/2", "\\boxed{\\frac12}", True),
  ("1/2", "\\boxed{2/4}", True),
  ("1/2", "\\boxed{0.50}", True),
  ("\\frac{3}{4}", "\\boxed{0.75}", True),
  ("\\frac{3}{4}", "\\boxed{3/4}", True),
  ("\\dfrac{3}{4}", "\\boxed{\\frac{3}{4}}", True),
  ("0.75", "\\boxed{\\frac{3}{4}}", True),
  ("0.75", "\\boxed{\\frac{4}{3}}", False),
  ("\\frac{1}{3}", "\\boxed{0.3333333}", True),
  ("\\frac{1}{3}", "\\boxed{0.33}", False),
  ("\\frac{2}{3}", "\\boxed{\\frac{4}{6}}", True),
  ("\\frac{7}{2}", "\\boxed{3.5}", True),
  ("\\frac{7}{2}", "\\boxed{3\\frac{1}{2}}", True),
  ("\\frac{-1}{2}", "\\boxed{-0.5}", True),
  ("-\\frac{1}{2}", "\\boxed{\\frac{-1}{2}}", True),
  ("-\\frac{1}{2}", "\\boxed{\\frac{1}{2}}", False),
  ("\\frac{5}{8}", "\\boxed{0.625}", True),
  ("\\frac{1}{8}", "\\boxed{0.125}", True),
  ("\\frac{1}{8}", "\\boxed{0.12}", False),
  ("\\frac{22}{7}", "\\boxed{\\frac{44}{14}}", True),
  ("\\frac{22}{7}", "\\boxed{3.14}", False),
  # integers, negatives, formatting
  ("42", "So the final answer is 42.", True),
  ("42", "\\boxed{42}", True),
  ("42", "\\boxed{42.0}", True),
  ("42", "\\boxed{042}", True),
  ("42", "\\boxed{43}", False),
  ("-7", "\\boxed{-7}", True),
  ("-7", "\\boxed{7}", False),
  ("-7", "The answer is -7.", True),
  ("-7", "\\boxed{-7.00}", True),
  ("-3", "\\boxed{-(3)}", True),
  ("1000", "\\boxed{1,000}", True),
  ("1000", "\\boxed{1{,}000}", True),
  ("1000000", "\\boxed{10^6}", True),
  ("1000000", "\\boxed{1,000,000}", True),
  ("0", "\\boxed{0}", True),
  ("0", "\\boxed{-0}", True),
  ("12", "We get 3 + 9 = 12, so the result is 12", True),
  ("12", "3 + 9 = 13", False),
  # percentages
  ("50\\%", "\\boxed{50\\%}", True),
  ("50\\%", "\\boxed{50}", True),
  ("50", "\\boxed{50\\%}", True),
  ("25\\%", "\\boxed{25 \\%}", True),
  ("25\\%", "\\boxed{30\\%}", False),
  ("12.5\\%", "\\boxed{12.5\\%}", True),
  # roots, pi, expressions
  ("\\sqrt{2}", "\\boxed{\\sqrt{2}}", True),
  ("\\sqrt{2}", "\\boxed{2^{1/2}}", True),
  ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", True),
  ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}", True),
  ("2\\sqrt{3}", "\\boxed{3\\sqrt{2}}", False),
  ("3\\sqrt{3}", "\\boxed{\\sqrt{27}}", True),
  ("\\pi", "\\boxed{\\pi}", True),
  ("2\\pi", "\\boxed{2 \\pi}", True),
  ("2\\pi", "\\boxed{\\pi}", False),
  ("\\frac{\\pi}{2}", "\\boxed{\\frac{1}{2}\\pi}", True),
  ("x^2+2x+1", "\\boxed{(x+1)^2}", True),
  ("x^2+2x+1", "\\boxed{(x-1)^2}", False),
  ("a+b", "\\boxed{b+a}", True),
  ("2x", "\\boxed{x+x}", True),
  ("e^{2}", "\\boxed{e^2}", True),
  ("\\infty", "\\boxed{\\infty}", True),
  ("10", "\\boxed{2 \\cdot 5}", True),
  ("10", "\\boxed{2 \\times 5}", True),
  ("6", "\\boxed{3!}", True),
  ("\\log_2 8", "\\boxed{3}", True),
  # intervals
  ("(1,2]", "\\boxed{(1,2]}", True),
  ("(1,2]", "\\boxed{(1, 2]}", True),
  ("(1,2]", "\\boxed{[1,2]}", False),
  ("(1,2]", "\\boxed{(1,2)}", False),
  ("[0,\\infty)", "\\boxed{[0, \\infty)}", True),
  ("(-\\infty, 3)", "\\boxed{(-\\infty,3)}", True),
  ("(-\\infty, 3)", "\\boxed{(-\\infty,3]}", False),
  ("(-\\infty,-2)\\cup(2,\\infty)", "\\boxed{(-\\infty,-2)\\cup(2,\\infty)}", True),
  ("(-\\infty,-2)\\cup(2,\\infty)", "\\boxed{(2,\\infty)\\cup(-\\infty,-2)}", True),
  ("[1,3]", "\\boxed{[1,3)}", False),
  # sets and tuples
  ("\\{1,2\\}", "\\boxed{\\{2,1\\}}", True),
  ("\\{1,2,3\\}", "\\boxed{\\{1,2\\}}", False),
  ("1,2", "\\boxed{2, 1}", True),
  ("(1,2)", "\\boxed{(1,2)}", True),
  ("(3,4)", "\\boxed{(4,3)}", False),
  # equations and variables
  ("3", "\\boxed{x=3}", True),
  ("x=3", "\\boxed{3}", True),
  ("y=2x+1", "\\boxed{y=2x+1}", True),
  ("y=2x+1", "\\boxed{y=1+2x}", True),
  ("y=2x+1", "\\boxed{y=2x-1}", False),
  # units and text
  ("10", "\\boxed{10 \\text{ cm}}", True),
  ("10", "\\boxed{10\\text{ meters}}", True),
  ("10", "\\boxed{10 \\mbox{ cm}}", True),
  ("5", "\\boxed{\\$5}", True),
  ("5", "\\boxed{5 \\text{ dollars}}", True),
  ("5", "\\boxed{6 \\text{ dollars}}", False),
  ("90", "\\boxed{90^\\circ}", True),
  ("90", "\\boxed{90^{\\circ}}", True),
  ("\\text{Monday}", "\\boxed{\\text{Monday}}", True),
  ("\\text{(B)}", "\\boxed{\\text{(B)}}", True),
  # decimals
  ("3.14", "\\boxed{3.14}", True),
  ("3.14", "\\boxed{3.140}", True),
  ("3.14", "\\boxed{3.15}", False),
  ("0.1", "\\boxed{.1}", True),
  ("0.1", "\\boxed{\\frac{1}{10}}", True),
  ("2.5", "\\boxed{\\frac{5}{2}}", True),
  ("-2.5", "\\boxed{-\\frac{5}{2}}", True),
  ("-2.5", "\\boxed{\\frac{5}{2}}", False),
  # extraction: last boxed wins, answer phrases, last number
  ("4", "First \\boxed{3}, then corrected: \\boxed{4}", True),
  ("4", "First \\boxed{4}, then corrected: \\boxed{3}", False),
  ("4", "<answer>4</answer>", True),
  ("4", "Answer: 4", True),
  ("4", "**Final Answer:** $4$", True),
  ("4", "The final answer is $\\boxed{4}$. I hope it is correct.", True),
  ("4", "2 + 2 = 4", True),
  ("\\frac{1}{2}", "The answer is \\(\\frac{1}{2}\\).", True),
  # malformed
  ("4", "", False),
  ("4", "I have no idea.", False),
  ("4", "\\boxed{", False),
  ("4", "\\boxed{}", False),
  ("4", "\\boxed{\\frac{4}{}", True),  # unbalanced: the last number
  ("4", "\\boxed{4", True),  # unbalanced: falls back to the last number
  ("4", "\\boxed{x+}", False),
  ("4", "}}}}{{{{", False),
]


def test_math_has_100_equivalence_cases():
  assert len(MATH_CASES) >= 100


@pytest.mark.parametrize("gold,completion,expected", MATH_CASES)
def test_math_equivalence(gold, completion, expected):
  result = math_answer.math_verifier(completion, {"answer": gold})
  assert isinstance(result, RewardResult)
  assert result.score == float(expected), (gold, completion, result)


def test_math_gold_formats():
  # GSM8K-style and \boxed{} reference solutions are reduced to their final answer.
  assert math_answer.math_verifier("\\boxed{72}", {"answer": "She sold 48/2 = 24 ... #### 72"}).score == 1.0
  assert math_answer.math_verifier("\\boxed{5}", {"answer": "so $x = \\boxed{5}$"}).score == 1.0
  assert math_answer.math_verifier("\\boxed{5}", {"answer": 5}).score == 1.0
  assert math_answer.math_verifier("\\boxed{5}", {"solution": "5"}, answer_key="solution").score == 1.0


def test_math_reports_the_extracted_answer():
  result = math_answer.math_verifier("so \\boxed{\\frac{1}{2}}.", {"answer": "0.5"})
  assert result.info["answer"] == "\\frac{1}{2}"
  assert math_answer.math_verifier("no number here", {"answer": "1"}).info["extracted"] == 0.0


def test_math_missing_answer_field_raises():
  with pytest.raises(KeyError, match="answer"):
    math_answer.math_verifier("\\boxed{1}", {"question": "?"})


def test_answer_extraction_helpers():
  assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
  assert last_boxed("\\boxed 7 apples") == "7"
  assert last_boxed("\\fbox{x^{2}}") == "x^{2}"
  assert last_boxed("nothing") is None
  assert final_answer("The final answer is $\\boxed{4}$. I hope it is correct.") == "4"
  assert final_answer("The answer to the puzzle is 12.") == "12"
  assert final_answer("x = 3, y = 4") == "4"
  assert to_fraction("$1,234.50") == to_fraction("2469/2")
  assert to_fraction("50\\%") == 50
  assert to_fraction("abc") is None


# ---- gsm8k ------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion,gold,expected", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", True),
    ("#### 1,234", "1234", True),
    ("The answer is $1,234.00.", "1234", True),
    ("He pays $18 per week.", "18", True),
    ("It takes 18 km/h", "18", True),
    ("So she has 50% left", "50", True),
    ("\\boxed{-3}", "-3", True),
    ("#### 0.5", "1/2", True),
    ("The answer is 72 apples, costing $5 each.", "72", True),
    ("#### 71", "72", False),
    ("Total = 73", "72", False),
    ("#### 7.2", "72", False),
    ("no numbers at all", "72", False),
    ("", "72", False),
    ("####", "72", False),
    ("#### 72", "She bought 3 ... so 72 in total.\n#### 72", True),
])
def test_gsm8k(completion, gold, expected):
  assert gsm8k.gsm8k_verifier(completion, {"answer": gold}).score == float(expected)


def test_gsm8k_tolerance_and_bad_gold():
  assert gsm8k.gsm8k_verifier("#### 3.3333", {"answer": "10/3"}, tolerance=1e-3).score == 1.0
  assert gsm8k.gsm8k_verifier("#### 3.3333", {"answer": "10/3"}).score == 0.0
  with pytest.raises(ValueError, match="not a number"):
    gsm8k.gsm8k_verifier("#### 1", {"answer": "many"})


# ---- countdown and arithmetic ----------------------------------------------------------------

CD = {"numbers": [3, 5, 7], "target": 22}


@pytest.mark.parametrize("completion,expected", [
    ("<answer>3 * 5 + 7</answer>", True),
    ("<answer>(7 + 5) * 3 - 14</answer>", False),  # 14 is not given
    ("<answer>7 * 3 + 5 - 4</answer>", False),
    ("I think: 5 * 3 + 7 = 22", True),
    ("<answer>5 \\times 3 + 7</answer>", True),
    ("<answer>5 × 3 + 7 = 22</answer>", True),
    ("<answer>3 * 5 + 7 = 23</answer>", False),  # a wrong claimed result
    ("<answer>3 * 5 + 8</answer>", False),       # 8 is not given
    ("<answer>3 * 5</answer>", False),           # 7 unused
    ("<answer>3 * 5 + 7 + 0</answer>", False),   # 0 not given
    ("<answer>3 * 5 + 7 * 1</answer>", False),
    ("<answer>22</answer>", False),
    ("<answer>__import__('os').system('ls')</answer>", False),
    ("<answer>3 ** 5 + 7</answer>", False),      # powers are not allowed
    ("<answer>(3 * 5 + 7</answer>", False),      # unbalanced
    ("<answer>" + "(" * 500 + "3" + ")" * 500 + "</answer>", False),
    ("", False),
    ("no expression", False),
])
def test_countdown(completion, expected):
  assert arith.countdown_verifier(completion, CD).score == float(expected), completion


def test_countdown_fractions_are_exact_and_use_all_is_optional():
  ex = {"numbers": [1, 3, 4, 6], "target": 24}
  assert arith.countdown_verifier("<answer>6 / (1 - 3 / 4)</answer>", ex).score == 1.0
  assert arith.countdown_verifier("<answer>6 / (1 - 3 / 0)</answer>", ex).score == 0.0
  assert arith.countdown_verifier("<answer>6 * 4</answer>", ex).score == 0.0
  assert arith.countdown_verifier("<answer>6 * 4</answer>", ex, use_all=False).score == 1.0
  assert arith.countdown_verifier("<answer>6 * 4 * 1 * 1</answer>", ex, use_all=False).score == 0.0
  with pytest.raises(KeyError, match="numbers"):
    arith.countdown_verifier("1", {"target": 1})


def test_safe_evaluate_rejects_everything_but_arithmetic():
  assert arith.evaluate("1/3 + 1/6")[0] == arith.Fraction(1, 2)
  assert arith.evaluate("-(2 - 5) * 2")[0] == 6
  for bad in ["x + 1", "abs(-1)", "2 ** 3", "1 if 1 else 2", "[1, 2]", "1 // 2", "1 % 2", "1e999", "'a'", "True",
              "1; 2", "lambda: 1", "9" * 1000, "1 / 0"]:
    with pytest.raises(arith.ExpressionError):
      arith.evaluate(bad)


@pytest.mark.parametrize("completion,gold,expected", [
    ("7 - 3 = 4", "4", True),
    ("The answer is 4.", "4", True),
    ("<answer>4</answer>", "4", True),
    ("\\boxed{8/2}", "4", True),
    ("It is 1,234", "1234", True),
    ("512 * 88 + 903 = 45959", "45959", True),
    ("7 - 3 = 5", "4", False),
    ("The answer is 4.5", "4", False),
    ("The answer is four", "4", False),
    ("", "4", False),
    ("-12", "-12", True),
    # Restating the question is not an answer, although the expression has the right value.
    ("9 - 8 = 9 - 8", "1", False),
    ("4 * 5 = 4 * 5", "20", False),
    ("3 - 2 = 3 + 2", "1", False),
    ("(9 - 8)", "1", False),
])
def test_arithmetic(completion, gold, expected):
  assert arith.arithmetic_verifier(completion, {"answer": gold}).score == float(expected), completion


def test_arithmetic_with_numbers_checks_usage():
  assert arith.arithmetic_verifier("<answer>3 * 5 + 7</answer>", CD).score == 1.0
  assert arith.arithmetic_verifier("<answer>22</answer>", CD).score == 0.0


# ---- format -----------------------------------------------------------------------------------

@pytest.mark.parametrize("completion,expected", [
    ("<think>reasoning</think><answer>4</answer>", 1.0),
    ("  <think>a\nb</think>\n<answer>4</answer>\n", 1.0),
    ("<answer>4</answer><think>x</think>", 0.0),
    ("<think>x</think>", 0.0),
    ("<think>x</think><answer>4</answer> trailing", 0.0),
    ("<think>x<think>y</think><answer>4</answer>", 0.0),
    ("", 0.0),
])
def test_format_tags(completion, expected):
  assert fmt.format_verifier(completion, {}).score == expected


def test_format_partial_credit_prefix_and_pattern():
  ex = {}
  assert fmt.format_verifier("<think>x</think><answer>4</answer>", ex, partial_credit=True).score == 1.0
  assert fmt.format_verifier("<think>x</think> <answer>4", ex, partial_credit=True).score == pytest.approx(1 / 3)
  assert fmt.format_verifier("nothing", ex, partial_credit=True).score == 0.0
  assert fmt.format_verifier("x</think><answer>4</answer>", ex, prefix="<think>").score == 1.0
  assert fmt.format_verifier("Result: 42", ex, pattern=r"Result: \d+").score == 1.0
  assert fmt.format_verifier("Result: 42!", ex, pattern=r"Result: \d+").score == 0.0
  assert fmt.format_verifier("<a>1</a><b>2</b>", ex, tags=["a", "b"]).score == 1.0
  with pytest.raises(ValueError, match="regex"):
    fmt.format_verifier.check_config(pattern="(")


# ---- choice -----------------------------------------------------------------------------------

@pytest.mark.parametrize("completion,gold,expected", [
    ("The answer is (B).", "B", True),
    ("The answer is B because A is wrong", "B", True),
    ("\\boxed{C}", "C", True),
    ("\\boxed{\\text{(C)}}", "C", True),
    ("<answer>d</answer>", "D", True),
    ("Answer: A", "(A)", True),
    ("After thinking...\nB", "B", True),
    ("After thinking...\n(B)", 1, True),
    ("The answer is (B).", "C", False),
    ("I am not sure", "A", False),
    ("The answer is a bit unclear", "A", False),
    ("", "A", False),
])
def test_choice(completion, gold, expected):
  assert choice.choice_verifier(completion, {"answer": gold}).score == float(expected), completion


def test_choice_with_option_text_and_more_letters():
  ex = {"answer": "Paris", "choices": ["London", "Paris", "Rome", "Oslo", "Bern"]}
  assert choice.choice_verifier("The answer is (B)", ex).score == 1.0
  ex = {"answer": "E", "choices": list("abcde")}
  assert choice.choice_verifier("The answer is E", ex).score == 1.0
  with pytest.raises(ValueError, match="letters"):
    choice.choice_verifier("A", {"answer": "Z"})


# ---- similarity -------------------------------------------------------------------------------

def test_similarity():
  call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
  reordered = '<answer>{"arguments": {"unit": "C", "city": "Paris"}, "name": "get_weather"}</answer>'
  assert similarity.similarity_verifier(reordered, {"answer": call}).score == 1.0
  close = similarity.similarity_verifier('{"name": "get_weather", "arguments": {"city": "Pariss"}}',
                                         {"answer": call}).score
  assert 0.5 < close < 1.0
  assert similarity.similarity_verifier("zzzz", {"answer": call}).score < 0.2
  assert similarity.similarity_verifier("Hello   World", {"answer": "hello world"}).score == 1.0
  assert similarity.similarity_verifier("hello there", {"answer": "hello world"}, threshold=1.0).score == 0.0
  assert similarity.similarity_verifier("", {"answer": {"a": 1}}).score == 0.0


# ---- overlong ---------------------------------------------------------------------------------

@pytest.mark.parametrize("length,expected", [(0, 0.0), (96, 0.0), (97, -1 / 32), (112, -0.5), (128, -1.0),
                                             (500, -1.0)])
def test_overlong_dapo_formula(length, expected):
  assert overlong.overlong_verifier("", {}, num_tokens=length, max_len=128, buffer=32) == pytest.approx(expected)


def test_overlong_needs_tokens_and_valid_config():
  with pytest.raises(ValueError, match="num_tokens"):
    overlong.overlong_verifier("", {}, num_tokens=None, max_len=128, buffer=32)
  with pytest.raises(ValueError, match="buffer"):
    overlong.overlong_verifier.check_config(max_len=16, buffer=32)


# ---- majority (group) -------------------------------------------------------------------------

def test_majority_group_verifier():
  out = majority.majority_verifier(["\\boxed{4}", "so 4.0", "\\boxed{5}", "nothing"], {})
  assert [r.score for r in out] == [1.0, 1.0, 0.0, 0.0]
  assert [r.score for r in majority.majority_verifier(["a", "b"], {})] == [0.0, 0.0]
  out = majority.majority_verifier(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"], {}, min_agreement=0.5)
  assert [r.score for r in out] == [0.0, 0.0, 0.0]


# ---- code (runs the sandbox) ------------------------------------------------------------------

STDIO = {"tests": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]}
ASSERTS = {"asserts": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}


@pytest.mark.parametrize("completion,example,expected", [
    ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", STDIO, 1.0),
    ("Here:\n```\na, b = map(int, input().split())\nprint(a - b)\n```", STDIO, 0.0),
    ("```python\ndef add(a, b):\n  return a + b\n```", ASSERTS, 1.0),
    ("```python\ndef add(a, b):\n  return a * b\n```", ASSERTS, 0.0),
    ("```python\ndef add(a, b) return\n```", ASSERTS, 0.0),             # syntax error
    ("no code at all", ASSERTS, 0.0),
    ("```python\nimport os\nos._exit(0)\ndef add(a, b):\n  return 0\n```", ASSERTS, 0.0),  # exit before tests
    ("```python\nimport sys\nsys.exit(0)\n```", STDIO, 0.0),
    ("```python\ndef add(a, b):\n  return a + b\n", ASSERTS, 1.0),      # unterminated fence
])
def test_code(completion, example, expected):
  assert code_exec.code_verifier(completion, example).score == expected


def test_code_partial_credit_and_humaneval_style():
  half = "```python\ndef add(a, b):\n  return a + b if a > 0 else 7\n```"
  result = code_exec.code_verifier(half, ASSERTS, partial_credit=True)
  assert result.score == 0.5 and result.info["passed"] == 0.5
  humaneval = {"test": "def check(candidate):\n  assert candidate(1, 2) == 3\n", "entry_point": "add"}
  assert code_exec.code_verifier("```python\ndef add(a, b):\n  return a + b\n```", humaneval).score == 1.0
  assert code_exec.code_verifier("```python\ndef add(a, b):\n  return a\n```", humaneval).score == 0.0
  with pytest.raises(KeyError, match="tests"):
    code_exec.code_verifier("print(1)", {"answer": "1"})


def test_all_builtins_are_registered():
  for name in ["math", "gsm8k", "countdown", "arithmetic", "format", "code", "choice", "similarity", "overlong",
               "majority"]:
    assert get_verifier(name).name == name
  assert get_verifier("majority").kind == "group"
  assert get_verifier("overlong").inline and get_verifier("overlong").wants_num_tokens
