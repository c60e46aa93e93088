#!/bin/bash
# The GPU check of kvpath on a CUDA machine with no package index: `tests/gpu`, then the service suites
# with every engine on device=auto (-> cuda), 12 pytest workers. Run from the repository root with the
# wheels the machine lacks in .whl/ (ignored by git; README "Tests" names them) and $OUT set to a folder for
# the logs (gpu.log, suite.log, the auto-policy clusters' service logs).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target /tmp/site . || exit 3
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
bin="$(python3 -c 'import os,sys;print(os.path.dirname(sys.executable))')"
printf '#!/bin/sh\nexec python3 -m services.cli "$@"\n' > "$bin/kvpath" && chmod +x "$bin/kvpath"
nvidia-smi -L; python3 -c "import torch,cupy;print(torch.__version__, torch.cuda.is_available(), cupy.__version__)"
IGN="--deselect=tests/integration/loadgen/test_loadgen_replay.py::test_mooncake_slice_time_and_length_scaled --ignore=tests/e2e --ignore=tests/integration/openai/test_smollm2_serving.py --ignore=tests/unit/gpu/test_gpu_smollm2.py --ignore=tests/unit/gpu/test_gpu_gguf.py"
timeout 150 python3 -m pytest -p no:cacheprovider -p no:benchmark -n 4 -q -rs tests/gpu 2>&1 | tee $OUT/gpu.log | tail -3
timeout ${SUITE_S:-300} python3 -m pytest -p no:cacheprovider -p no:benchmark -n 12 -q -rfE --basetemp=/tmp/bt $IGN tests/integration tests/faults 2>&1 | tee $OUT/suite.log | tail -40
cd /tmp/bt && tar czf $OUT/auto-logs.tgz $(find . -path '*auto-pd*' -name '*.log' | head -40) 2>/dev/null; ls -la $OUT
