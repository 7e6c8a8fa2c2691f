# Sourced by the device scripts from the repository root: packages missing on the GPU image
# travel as wheels in .whl (see the device README) and go to /tmp/site; this checkout goes on
# PYTHONPATH. Sets PY (the interpreter, $PYTHON or python3).
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
