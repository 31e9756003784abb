source .gpu/run.sh
python benchmarks/results/experiments/ce_split_row_probe.py 2>&1 | tee $OUT/ce_split_row_h200.txt
