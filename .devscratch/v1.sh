set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
python -c "import cupy; print(cupy.__version__)"
timeout 150 python .devscratch/fault_probe.py main $OUT > $OUT/probe.txt 2>&1; tail -30 $OUT/probe.txt
timeout 200 python benchmarks/verifier_throughput.py --inline 0 --repeats 3 --json $OUT/crash4.json > $OUT/crash4.txt 2>&1; cat $OUT/crash4.txt
timeout 150 python benchmarks/verifier_throughput.py --inline 0 --repeats 3 --crash-every 0 --json $OUT/crash0.json > $OUT/crash0.txt 2>&1; cat $OUT/crash0.txt
