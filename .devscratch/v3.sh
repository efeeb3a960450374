timeout 120 python .devscratch/crash_anat.py > $OUT/crash_anat.txt 2>&1; cat $OUT/crash_anat.txt
timeout 120 python .devscratch/win_anat.py relu softmax matmul diag_matmul mean_dim > $OUT/win.txt 2>&1; cat $OUT/win.txt
for w in 8 10; do timeout 150 python benchmarks/verifier_throughput.py --inline 0 --repeats 1 --cov-tasks relu --workers $w --crash-every 0 > $OUT/w${w}c0.txt 2>&1; head -12 $OUT/w${w}c0.txt; done
timeout 150 python benchmarks/verifier_throughput.py --inline 0 --repeats 1 --cov-tasks relu --workers 8 > $OUT/w8c4.txt 2>&1; head -14 $OUT/w8c4.txt
timeout 150 python benchmarks/verifier_throughput.py --inline 0 --repeats 1 --cov-tasks relu --timing-window-ms 0.1 --crash-every 0 > $OUT/tw01.txt 2>&1; head -14 $OUT/tw01.txt
