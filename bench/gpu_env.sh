# Sourced from the repository root by the scripts for a lent GPU machine (bench/gpu_checks.sh,
# bench/reproduce/run_gpu.sh), with $PY set: what the project needs beyond that machine's
# image. .gpu/whl/*.whl (ignored by git; wheels for its Python) go into /tmp/site, ahead of the
# repository on PYTHONPATH, unless NOWHEELS is set (a dry run on this box); .gpu/fashion-mnist/
# holds the Debian package's Fashion-MNIST files.
if [ -z "${NOWHEELS:-}" ] && compgen -G ".gpu/whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if [ -d .gpu/fashion-mnist ]; then export P2PFL_DATA_DIR=$PWD/.gpu/fashion-mnist; fi
