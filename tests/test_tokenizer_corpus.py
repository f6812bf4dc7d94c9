"""Shared test strings for the tokenizer tests (no tests of its own)."""
import random

HANDWRITTEN = [
    "", " ", "  ", "\t", "\n", "\n\n", " \n ", "\r\n", "hello", "Hello world!", " leading", "trailing ",
    "multiple   spaces", "tabs\tand\ttabs", "line1\nline2\r\nline3", "numbers 1234567890 3.14159 -42 1e10 0x1F",
    "x =  3", "\t\t456", "2024-01-01T12:00:00Z", "Ünïcödé çàfé naïve", "日本語のテキスト", "中文测试，标点。",
    "한국어 텍스트", "Привет, мир", "مرحبا بالعالم", "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦", "🤖🤖🤖", "math: ∑_{i=1}^n x_i² ≤ ∞",
    "code: def f(x):\n    return x**2\n", "don't won't I'm you're they've", "   \t\n  mixed\t \n",
    "URL https://example.com/path?q=1&r=2#frag", "email a.b@c.de", "\u00a0nbsp\u00a0", "zero\u200bwidth",
    "ﬁ ligature ＡＢＣ full width １２３", "combining e\u0301 vs é", "$$\\frac{a}{b}$$",
    "JSON {\"k\": [1, 2, {\"x\": null}]}",
    "....!!!???", "'''\"\"\"```", "The answer is \\boxed{42}.", "x" * 200, " ".join(["word"] * 50), "\n" * 10, " " * 17,
    "\t" * 5 + "x",
]
WITH_SPECIALS = [
    "<|im_start|>user\nhi<|im_end|>", "text<|endoftext|>more", "<|im_end|><|im_end|>", "<|im_start|>",
    "a<|im_start|>b", "<repo_name>x", "<s> </s> <unk>", " <|im_end|> spaced ",
]
PIECES = ["a", "the", " ", "  ", "\t", "\n", "1", "23", "456", "日本", "😀", "é", "ß", "!", "?", ",", ".", "Hello",
          "world", "λ", "Ω", "→", "ー", "한", "щ", "'s", "n't", "12.5", "%", "#", "@",
          "\u3000"]
SPECIAL_PIECES = ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]


def corpus(n: int = 300, seed: int = 0, specials: bool = True) -> list[str]:
  """Hand-written edge cases, then random concatenations of awkward pieces, `n` strings in all."""
  rng = random.Random(seed)
  pieces = PIECES + (SPECIAL_PIECES if specials else [])
  out = HANDWRITTEN + (WITH_SPECIALS if specials else [])
  while len(out) < n:
    out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 25))))
  return out
