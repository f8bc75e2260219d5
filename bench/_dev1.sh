set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPYCACHEPREFIX=$(mktemp -d); unset PYTHONDONTWRITEBYTECODE
cfg=$(mktemp -d)
timeout 370 python bench/tune_moe.py --out-dir $cfg --budget-s 300 --workers 14 2>&1 | grep -E "best|variants|compiled|Error" | tail -20
cp $cfg/*.json $OUT/h200_tuned.json
export COMPILED_MOE_CONFIG_DIR=$cfg
timeout 120 python bench/moe_bench.py --out $OUT/moe_bench_tuned.json 2>&1 | tail -9
timeout 90 python -m pytest -m gpu -q tests/test_moe_kernels.py 2>&1 | tail -2
