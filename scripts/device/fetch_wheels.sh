#!/usr/bin/env bash
# Downloads, here (from PyPI), the wheels that the lent GPU machine lacks, for its Python 3.12 on
# manylinux x86_64, into .wheels/ (git-ignored; name it in the device tool's `carry`), and prints the
# list and the total size. scripts/device/gpu_check.sh installs them there with --no-deps --no-index.
#
#   bash scripts/device/fetch_wheels.sh [DEST]          # DEST defaults to .wheels at the repo root
#
# The machine (an image with jax 0.11.2 + CUDA 13 plugin, flax, optax, orbax-checkpoint, chex, torch,
# transformers 5.17, peft, accelerate, sentencepiece, tokenizers, safetensors, pyarrow, pandas, ...)
# lacks these, pinned to the versions rljax's tests run with (jax 0.11.2 needs none of them to change):
#   grain + array-record + portpicker: rljax's data pipeline (grain imports both at import time)
#   ml_collections, gin-config: the run configuration
#   math-verify + latex2sympy2_extended + antlr4-python3-runtime: the `math` verifiers
#   gguf: GGUF models and tokenizers; tensorboardX: the metrics writer
#   trl + datasets + dill + multiprocess: the GRPO step of TRL that gpu_check.sh compares with
# Not carried: tensorflow-datasets (rljax imports it lazily, only for `kind="tfds"` data sources, which
# the check does not use) and its dependencies.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${1:-$ROOT/.wheels}"
PY="${PYTHON:-python3}"
LIMIT_MIB="${WHEELS_LIMIT_MIB:-32}"   # the copied tree is limited to 64 MiB in all: keep room to spare

WHEELS=(
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0
  ml_collections==1.1.0 gin-config==0.5.0
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  gguf==0.19.0 tensorboardX==2.6.5
  trl==1.16.0 datasets==4.8.4 dill==0.4.0 multiprocess==0.70.18
)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl   # one version of each package: two would stop the install there
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "${WHEELS[@]}"

"$PY" - "$DEST" "$LIMIT_MIB" "${WHEELS[@]}" <<'EOF'
"""Checks the folder (one wheel per pinned package, under the size limit) and prints the list."""
import email.parser
import os
import re
import sys
import zipfile

dest, limit_mib, pins = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()


def applies(req: str) -> bool:
  """Whether a Requires-Dist line applies to CPython 3.12 on Linux without extras."""
  try:
    from packaging.requirements import Requirement
  except ImportError:   # no packaging here: drop extras and Windows-only lines only
    return "extra ==" not in req and 'sys_platform == "win32"' not in req
  marker = Requirement(req).marker
  env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
         "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
         "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
  return marker is None or marker.evaluate(env)


wheels = sorted(f for f in os.listdir(dest) if f.endswith(".whl"))
names = {}
needs = set()
for w in wheels:
  with zipfile.ZipFile(os.path.join(dest, w)) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = email.parser.Parser().parsestr(z.read(meta).decode("utf-8"))
  names.setdefault(norm(msg["Name"]), []).append(w)
  for req in msg.get_all("Requires-Dist") or []:
    if applies(req):
      needs.add(norm(re.match(r"[A-Za-z0-9_.\-]+", req).group(0)))
wanted = {norm(p.split("==")[0]) for p in pins}
dupes = {n: ws for n, ws in names.items() if len(ws) > 1}
missing = wanted - set(names)
total = sum(os.path.getsize(os.path.join(dest, w)) for w in wheels)
for w in wheels:
  print(f"{os.path.getsize(os.path.join(dest, w)) / 2**20:8.2f} MiB  {w}")
print(f"{total / 2**20:8.2f} MiB  total, {len(wheels)} wheels in {dest} (limit {limit_mib:g} MiB)")
print("their requirements expected on the machine: " + ", ".join(sorted(needs - set(names))))
if dupes or missing or total > limit_mib * 2**20:
  sys.exit(f"fetch_wheels: duplicates {dupes or 'none'}, missing {sorted(missing) or 'none'}, "
           f"total {total / 2**20:.2f} MiB against a limit of {limit_mib:g} MiB")
EOF
