timeout 200 python .devscratch/fault_probe.py main $OUT > $OUT/probe.txt 2>&1; tail -30 $OUT/probe.txt
timeout 200 python .devscratch/prof_timing.py 40 > $OUT/prof.txt 2>&1; head -150 $OUT/prof.txt
