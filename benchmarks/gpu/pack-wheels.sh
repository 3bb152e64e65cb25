#!/usr/bin/env bash
# Pack vLLM 0.23.0 (torch 2.11, the H200 machine's own) and the wheels that machine lacks into
# parts for the device tool: .gpu-parts/p0 .. pN. A call carries 64 MiB with the working tree
# (~12 MB), so a part is 50 MiB (PART_MIB).
# Differs from ../shared/gpu/make-parts.sh in three ways: vLLM's wheel is slimmed (kernels a dense
# model on Hopper never loads: FA2 (FA3 is used on sm90), the MoE ops (imported in a
# contextlib.suppress), the Rust frontend binary, deep_gemm builds for other Pythons), math-verify
# and its two dependencies are added (opd-score --reward math in the DAPO-shaped loop), and a
# cryptography wheel whose listed manylinux tag pip no longer finds is taken under the tag it finds.
# Run from the project root; then on the GPU machine `bash .gpu-parts/pK/append.sh` for each K in
# order, `final` on the last (../shared/gpu/append.sh).
set -euo pipefail
shared=${OPD_SHARED_GPU:-../shared/gpu}
cache=${GPU_WHEEL_CACHE:-$HOME/.cache/opd-gpu-wheels}; mkdir -p "$cache"
part_mib=${PART_MIB:-50}
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in 2_35 2_34 2_31 2_28 2_27 2_26 2_24 2_17 2_5; do plat+=(--platform "manylinux_${p}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
list=$(mktemp)
while read -r whl; do
  [ -z "$whl" ] && continue
  name=${whl%%-*}; rest=${whl#*-}; ver=${rest%%-*}
  found=$(ls "$cache/$name-$ver-"*.whl 2>/dev/null | head -1 || true)
  if [ -z "$found" ]; then python3 -m pip download -q --no-deps "${plat[@]}" -d "$cache" "$name==$ver"
     found=$(ls "$cache/$name-$ver-"*.whl | head -1); fi
  basename "$found" >> "$list"
done < <(cat "$shared/vllm-0.23.0-wheels.txt"; printf '%s\n' math_verify-0.9.0-x latex2sympy2_extended-1.11.0-x antlr4_python3_runtime-4.13.2-x)
vllm=$(grep '^vllm-' "$list"); slim=${vllm/vllm-0.23.0/vllm-0.23.0}
work=$(mktemp -d); cp "$cache/$vllm" "$work/$slim"
zip -q -d "$work/$slim" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/_moe_C.abi3.so' 'vllm/vllm-rs' \
    'vllm/third_party/deep_gemm/_C.cpython-31[0134]-*' >/dev/null
grep -qx '.gpu-parts/' .git/info/exclude 2>/dev/null || echo '.gpu-parts/' >> .git/info/exclude
rm -rf .gpu-parts && mkdir -p .gpu-parts
(cd "$cache" && tar chf - $(grep -v '^vllm-' "$list")) > .gpu-parts/all.tar
tar rf .gpu-parts/all.tar -C "$work" "$slim"
sha=$(sha256sum .gpu-parts/all.tar | cut -d' ' -f1)
(cd .gpu-parts && split -b "${part_mib}M" -d -a 1 all.tar part && rm all.tar)
n=0; for f in .gpu-parts/part*; do
  i=${f##*part}; mkdir -p .gpu-parts/p$i; mv "$f" .gpu-parts/p$i/; cp "$shared/append.sh" .gpu-parts/p$i/
  echo "$sha" > .gpu-parts/p$i/all.sha; n=$i; done
rm -rf "$work" "$list"
echo "parts: .gpu-parts/p0 .. .gpu-parts/p$n ($(du -sh .gpu-parts | cut -f1)); the last call runs: bash .gpu-parts/p$n/append.sh final"
