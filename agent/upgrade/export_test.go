package upgrade

import "time"

// RunGuard runs the guard loop on dir with test-sized waits.
func RunGuard(dir string) error { return guard(dir, 10*time.Millisecond, time.Second) }

const (
	TrialFile   = trialFile
	OutcomeFile = outcomeFile
)

// WriteTrial writes a trial record as swap would, for the guard tests.
func WriteTrial(dir string, target, from, exe, previous string, pid int, bound time.Duration, env []string) error {
	now := time.Now()
	return writeJSON(dir+"/"+trialFile, trial{Target: target, From: from, RolloutID: "ro-1", Attempt: 1, SHA256: "ab", Exe: exe,
		Previous: previous, PID: pid, Started: now, Deadline: now.Add(bound), Args: []string{exe}, Env: env})
}

var DownloadDetail = downloadDetail
