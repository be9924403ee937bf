# Sourced by ci/test.sh and ci/test-python.sh: the one virtual environment
# the tests' Python runs in (Debian's python3 refuses system-wide pip
# installs, PEP 668). Sets `venv` (KVLANE_VENV, default target/py-venv) and
# `pip` (that venv's pip, quiet), creating the venv when it is missing.
venv=$(realpath -m "${KVLANE_VENV:-target/py-venv}")
if [ ! -x "$venv/bin/python" ]; then
  if ! python3 -m venv "$venv" 2>/dev/null; then
    # Debian ships venv's pip bootstrap separately.
    echo "ci/py-venv.sh: installing python3-venv" >&2
    if [ "$(id -u)" = 0 ]; then apt-get install -y -qq python3-venv; else sudo apt-get install -y -qq python3-venv; fi
    rm -rf "$venv"
    python3 -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
