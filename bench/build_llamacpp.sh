#!/usr/bin/env bash
# Build the llama.cpp command-line tools used by bench/llamacpp.py, from the
# llama.cpp copy vendored in a pinned llama-cpp-python sdist on PyPI.
#
# Everything lives OUTSIDE the repo, under $SPECD_BENCH_DIR
# (default ~/.cache/specd-bench):
#   dl/      the sdist, fetched with `pip download --require-hashes`
#   src/     the unpacked sdist (vendor/llama.cpp holds llama.cpp + convert_hf_to_gguf.py)
#   build/   the CMake build (CPU only, GGML_NATIVE=ON, OpenMP, static libs)
#   bin/     symlinks to the built binaries (pass this dir to bench/llamacpp.py)
#   llama.cpp -> src/.../vendor/llama.cpp   (convenience link: convert_hf_to_gguf.py etc.)
#
# Idempotent: each step is skipped when its output is already there; the
# build is incremental. Re-run with FORCE_CONFIGURE=1 to re-run cmake.
#
# Usage:  bash bench/build_llamacpp.sh            # download + build
#         JOBS=1 bash bench/build_llamacpp.sh     # fewer compile jobs
#         bash bench/build_llamacpp.sh --print-dir   # just print the bin dir
#         NO_AMX=1 bash bench/build_llamacpp.sh       # AVX-512 (+VNNI, BF16), AMX off, not native: into
#             build-<version>-noamx/ and bin-noamx/. On an AMX Xeon (family 6 model 167) the native build
#             segfaults in ggml-cpu on a Q4_K_M file (llama-bench, rc 139; 2026-12-02); this one runs.
#         bash bench/build_llamacpp.sh --with-models  # also: converter venv + GGUFs:
#             $TARGET_HF_DIR (default: the fetched default target, `specd models path target`) -> models/<name>-f32.gguf, -bf16.gguf,
#             Q8_0 and Q4_K_M quantized from the f32 one (llama-quantize),
#             a 2-layer stand-in draft (truncated target) -> models/draft-2l-f32.gguf,
#             and $DRAFTER_HF_DIR (default: the default target's trained drafter, `specd models path drafter`,
#             distilled from the target on its own answers) -> models/<name>-drafter-Q8_0.gguf: with the Q4_K_M
#             target, a GGUF pair as llama.cpp users run speculation (bench/real_pair_gguf.py)
#
# The converter (convert_hf_to_gguf.py, vendored in the sdist) needs torch,
# transformers, numpy and sentencepiece. venv-convert/ is a small venv that
# layers sentencepiece over the site-packages of $CONVERT_BASE_PYTHON (default:
# the repo's .venv, which has torch + transformers), so no second torch install.
set -euo pipefail

LCP_VERSION="0.3.36"
LCP_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

BENCH_DIR="${SPECD_BENCH_DIR:-$HOME/.cache/specd-bench}"
JOBS="${JOBS:-2}"
PIP="${PIP:-python3 -m pip}"

DL_DIR="$BENCH_DIR/dl"
SRC_DIR="$BENCH_DIR/src"
SDIST="$DL_DIR/llama_cpp_python-$LCP_VERSION.tar.gz"
LLAMA_SRC="$SRC_DIR/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
BUILD_DIR="$BENCH_DIR/build-$LCP_VERSION"
BIN_DIR="$BENCH_DIR/bin"
CPU_FLAGS=(-DGGML_NATIVE=ON)
if [[ -n "${NO_AMX:-}" ]]; then
    BUILD_DIR="$BUILD_DIR-noamx"
    BIN_DIR="$BIN_DIR-noamx"
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
               -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON
               -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi

# Targets: plain decoding (llama-completion is the old `main`; llama-cli in
# this llama.cpp version is a chat front-end linked against the server, so we
# do not build it), timing (llama-bench, llama-simple), speculative decoding
# with a draft model (llama-speculative, llama-speculative-simple), and
# prompt-lookup / n-gram decoding (llama-lookup, llama-lookahead), and the OpenAI-compatible
# server (llama-server) that bench/default_stack.py serves side by side with specd, and the
# quantizer and perplexity tool that bench/quant.py compares quantized serving with.
TARGETS=(llama-completion llama-simple llama-bench llama-speculative
         llama-speculative-simple llama-lookup llama-lookahead llama-tokenize llama-server
         llama-quantize llama-perplexity llama-batched-bench)

WITH_MODELS=""
case "${1:-}" in
    --print-dir) echo "$BIN_DIR"; exit 0 ;;
    --with-models) WITH_MODELS=1 ;;
    "") ;;
    *) echo "usage: $0 [--print-dir|--with-models]" >&2; exit 2 ;;
esac
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONVERT_BASE_PYTHON="${CONVERT_BASE_PYTHON:-$REPO_ROOT/.venv/bin/python}"
TARGET_HF_DIR="${TARGET_HF_DIR:-$("$REPO_ROOT/.venv/bin/specd" models path target 2>/dev/null || echo /nonexistent)}"
DRAFTER_HF_DIR="${DRAFTER_HF_DIR:-$("$REPO_ROOT/.venv/bin/specd" models path drafter 2>/dev/null || echo /nonexistent)}"
SENTENCEPIECE_SPEC="sentencepiece>=0.1.98,<0.3.0"

log() { echo "[build_llamacpp] $*" >&2; }

# 1. download the pinned sdist, hash-checked by pip ------------------------
mkdir -p "$DL_DIR" "$SRC_DIR"
have_sha=""
[[ -f "$SDIST" ]] && have_sha="$(sha256sum "$SDIST" | cut -d' ' -f1)"
if [[ "$have_sha" != "$LCP_SHA256" ]]; then
    rm -f "$SDIST"
    req="$DL_DIR/requirements-llama-cpp-python.txt"
    echo "llama-cpp-python==$LCP_VERSION --hash=sha256:$LCP_SHA256" > "$req"
    log "downloading llama-cpp-python==$LCP_VERSION sdist (hash-pinned)"
    # (pip prepares the sdist's metadata, so it fetches scikit-build-core into
    # a throw-away build env; nothing is installed)
    $PIP download --no-deps --no-binary :all: --require-hashes \
        -d "$DL_DIR" -r "$req" >&2
    have_sha="$(sha256sum "$SDIST" | cut -d' ' -f1)"
    if [[ "$have_sha" != "$LCP_SHA256" ]]; then
        log "sha256 mismatch for $SDIST: $have_sha"; exit 1
    fi
fi
log "sdist ok: $SDIST (sha256 $LCP_SHA256)"

# 2. unpack ------------------------------------------------------------------
if [[ ! -f "$LLAMA_SRC/CMakeLists.txt" ]]; then
    log "unpacking into $SRC_DIR"
    tar xzf "$SDIST" -C "$SRC_DIR"
fi
ln -sfn "$LLAMA_SRC" "$BENCH_DIR/llama.cpp"
if [[ -f "$LLAMA_SRC/convert_hf_to_gguf.py" ]]; then
    log "converter: $LLAMA_SRC/convert_hf_to_gguf.py"
else
    log "WARNING: convert_hf_to_gguf.py not in the sdist"
fi

# 3. configure + build ------------------------------------------------------
command -v cmake >/dev/null || { log "cmake missing: apt-get install -y cmake build-essential"; exit 1; }
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" || -n "${FORCE_CONFIGURE:-}" ]]; then
    log "configuring in $BUILD_DIR"
    cmake -S "$LLAMA_SRC" -B "$BUILD_DIR" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        "${CPU_FLAGS[@]}" \
        -DGGML_OPENMP=ON \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
        -DGGML_BACKEND_DL=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_BUILD_TOOLS=ON >&2
fi
log "building ${TARGETS[*]} with -j $JOBS"
cmake --build "$BUILD_DIR" --config Release -j "$JOBS" --target "${TARGETS[@]}" >&2

# 4. collect -----------------------------------------------------------------
mkdir -p "$BIN_DIR"
found=()
for t in "${TARGETS[@]}"; do
    if [[ -x "$BUILD_DIR/bin/$t" ]]; then
        ln -sfn "$BUILD_DIR/bin/$t" "$BIN_DIR/$t"
        found+=("$t")
    else
        log "WARNING: $t was not built"
    fi
done
grep -E '^(GGML_NATIVE|GGML_OPENMP|GGML_AVX512|GGML_AMX)[A-Z_]*:' "$BUILD_DIR/CMakeCache.txt" >&2 || true
# 5. optional: converter venv + GGUFs ---------------------------------------
if [[ -n "$WITH_MODELS" ]]; then
    VENV="$BENCH_DIR/venv-convert"
    if [[ ! -x "$VENV/bin/python" ]]; then
        [[ -x "$CONVERT_BASE_PYTHON" ]] || { log "CONVERT_BASE_PYTHON=$CONVERT_BASE_PYTHON missing (needs torch+transformers)"; exit 1; }
        log "creating $VENV over $CONVERT_BASE_PYTHON"
        "$CONVERT_BASE_PYTHON" -m venv "$VENV"
        base_site="$("$CONVERT_BASE_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        venv_site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        echo "$base_site" > "$venv_site/_specd_base.pth"
    fi
    "$VENV/bin/python" -c 'import sentencepiece' 2>/dev/null \
        || "$VENV/bin/python" -m pip install -q "$SENTENCEPIECE_SPEC" >&2
    "$VENV/bin/python" -c 'import torch, transformers, numpy, sentencepiece, safetensors' \
        || { log "venv-convert lacks torch/transformers/numpy/safetensors"; exit 1; }
    MODELS="$BENCH_DIR/models"; mkdir -p "$MODELS"
    if [[ -f "$TARGET_HF_DIR/config.json" ]]; then
        name="$(basename "$TARGET_HF_DIR")"
        [[ "$name" == smol ]] && name="smollm2-135m-instruct"
        for t in f32 bf16; do
            out="$MODELS/$name-$t.gguf"
            if [[ ! -s "$out" ]]; then
                log "converting $TARGET_HF_DIR -> $out"
                "$VENV/bin/python" "$LLAMA_SRC/convert_hf_to_gguf.py" "$TARGET_HF_DIR" \
                    --outtype "$t" --outfile "$out.tmp" > "$MODELS/convert_$name-$t.log" 2>&1 \
                    || { log "conversion failed, see $MODELS/convert_$name-$t.log"; exit 1; }
                mv "$out.tmp" "$out"
            fi
            log "target GGUF ($t): $out"
        done
        # The quantized files users run (bench/quant.py), made from the f32 file as llama.cpp's README does.
        for q in Q8_0 Q4_K_M; do
            out="$MODELS/$name-$q.gguf"
            if [[ ! -s "$out" ]]; then
                log "quantizing -> $out"
                "$BIN_DIR/llama-quantize" "$MODELS/$name-f32.gguf" "$out.tmp" "$q" > "$MODELS/quantize_$name-$q.log" 2>&1 \
                    || { log "quantizing failed, see $MODELS/quantize_$name-$q.log"; exit 1; }
                mv "$out.tmp" "$out"
            fi
            log "target GGUF ($q): $out"
        done
        if [[ ! -s "$MODELS/draft-2l-f32.gguf" ]]; then
            log "making the 2-layer stand-in draft"
            "$VENV/bin/python" "$REPO_ROOT/bench/llamacpp.py" make-standin-draft \
                --src "$TARGET_HF_DIR" --out "$MODELS/draft-2l-hf" --layers 2 >&2
            "$VENV/bin/python" "$REPO_ROOT/bench/llamacpp.py" convert --hf-dir "$MODELS/draft-2l-hf" \
                --out "$MODELS/draft-2l-f32.gguf" --outtype f32 --python "$VENV/bin/python" >&2
        fi
        log "stand-in draft GGUF: $MODELS/draft-2l-f32.gguf"
        if [[ -f "$DRAFTER_HF_DIR/config.json" && ! -s "$MODELS/$name-drafter-Q8_0.gguf" ]]; then
            log "converting the trained drafter $DRAFTER_HF_DIR -> $MODELS/$name-drafter-Q8_0.gguf"
            "$VENV/bin/python" "$REPO_ROOT/bench/llamacpp.py" convert --hf-dir "$DRAFTER_HF_DIR" \
                --out "$MODELS/$name-drafter-Q8_0.gguf" --outtype q8_0 --python "$VENV/bin/python" >&2
        fi
        [[ -s "$MODELS/$name-drafter-Q8_0.gguf" ]] && log "trained draft GGUF (Q8_0): $MODELS/$name-drafter-Q8_0.gguf"
    else
        log "TARGET_HF_DIR=$TARGET_HF_DIR has no config.json; skipping GGUF conversion"
    fi
fi

log "binaries (${#found[@]}): ${found[*]}"
log "bin dir: $BIN_DIR"
log "llama.cpp source (convert_hf_to_gguf.py): $BENCH_DIR/llama.cpp"
echo "$BIN_DIR"
