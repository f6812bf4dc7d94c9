"""rljax/gguf_file.py: the one GGUF header reader, against the `gguf` package's own reader and writer."""
import numpy as np
import pytest

from rljax import gguf_file

gguf = pytest.importorskip("gguf")


def write(path, endianess=None, tokens=True):
  """A tensor-less GGUF with one value of each kind; the vocabulary (a string array) after the context."""
  kwargs = {} if endianess is None else {"endianess": endianess}
  w = gguf.GGUFWriter(str(path), "llama", **kwargs)
  w.add_context_length(321)
  w.add_uint32("llama.block_count", 3)
  w.add_float32("llama.rope.freq_base", 0.5)
  w.add_bool("tokenizer.ggml.add_bos_token", True)
  w.add_string("tokenizer.chat_template", "{{ messages }} \u00e9")
  w.add_array("tokenizer.ggml.scores", [0.25, -1.5, 3.0])
  w.add_array("tokenizer.ggml.token_type", [1, 3, 6])
  if tokens:
    w.add_array("tokenizer.ggml.tokens", ["a", "\u0120b", "<|x|>"])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


@pytest.mark.parametrize("order", ["little", "big"])
def test_metadata_matches_the_gguf_package_reader(tmp_path, order):
  endianess = gguf.GGUFEndian.BIG if order == "big" else None
  path = write(tmp_path / "m.gguf", endianess)
  ours = gguf_file.read_metadata(path)
  theirs = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
  assert ours == theirs
  assert ours["llama.context_length"] == 321 and ours["tokenizer.ggml.tokens"] == ["a", "\u0120b", "<|x|>"]
  assert gguf_file.read_metadata(path, keep=lambda k: k.startswith("tokenizer.ggml.t")) == {
      "tokenizer.ggml.token_type": [1, 3, 6], "tokenizer.ggml.tokens": ["a", "\u0120b", "<|x|>"]}
  assert gguf_file.context_length(path) == 321


def test_context_length_stops_before_the_vocabulary_and_cut_files_are_named(tmp_path):
  path = write(tmp_path / "m.gguf")
  data = open(path, "rb").read()
  # Cut inside the vocabulary: the context (read first) is still there, the full read refuses.
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:data.index(b"<|x|>") + 2])
  assert gguf_file.context_length(str(cut)) == 321
  with pytest.raises(gguf_file.GGUFFormatError, match="corrupt or truncated GGUF header"):
    gguf_file.read_metadata(str(cut))
  for head, message in ((b"GGU", "not a GGUF file"), (b"GGUF\x03\x00", "the file ends after 6 bytes"),
                        (b"GGUF\x09\x00\x00\x00" + bytes(16), "GGUF version 9 is not supported"),
                        (b"GGUF\x03\x00\x00\x00" + b"\xff" * 24, "runs past the end of the file")):
    cut.write_bytes(head)
    with pytest.raises(gguf_file.GGUFFormatError, match=message):
      gguf_file.read_metadata(str(cut))
  # No architecture: no context to read (the loader reports the file).
  w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.close()
  bare = gguf_file.read_metadata(str(tmp_path / "bare.gguf"))
  assert gguf_file.context_length(str(tmp_path / "bare.gguf")) == gguf_file.DEFAULT_CONTEXT_LENGTH
  assert bare == {"general.architecture": "llama"}


def test_plain_reader_reads_tensors_like_the_package_reader(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  w.add_tensor("token_embd.weight", x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  [t] = gguf_file.plain_reader_class()(str(tmp_path / "t.gguf"), "r").tensors
  assert type(t.data) is np.ndarray and np.array_equal(t.data, x)
