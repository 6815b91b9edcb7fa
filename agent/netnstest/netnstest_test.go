package netnstest

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestInnerResultReadsTheTestsOwnVerdictAndSkipReason(t *testing.T) {
	cases := []struct {
		name, test, out string
		verdict, reason string
	}{
		{
			name:    "pass",
			test:    "TestA",
			out:     "=== RUN   TestA\n    a_test.go:3: booted\n--- PASS: TestA (1.20s)\nPASS\n",
			verdict: "PASS",
		},
		{
			name:    "skip passes its reason through",
			test:    "TestA",
			out:     "=== RUN   TestA\n    a_test.go:9: needs /dev/kvm to run a guest\n--- SKIP: TestA (0.00s)\nPASS\n",
			verdict: "SKIP", reason: "a_test.go:9: needs /dev/kvm to run a guest",
		},
		{
			name:    "a subtest's skip is read at its own indent",
			test:    "TestA/sub",
			out:     "=== RUN   TestA\n=== RUN   TestA/sub\n        a_test.go:9: no kvm\n    --- SKIP: TestA/sub (0.00s)\n--- PASS: TestA (0.00s)\n",
			verdict: "SKIP", reason: "a_test.go:9: no kvm",
		},
		{
			name: "another test's verdict is not this one's",
			test: "TestA",
			out:  "=== RUN   TestAB\n--- PASS: TestAB (0.00s)\nPASS\n",
		},
		{
			name:    "fail",
			test:    "TestA",
			out:     "=== RUN   TestA\n--- FAIL: TestA (0.00s)\nFAIL\n",
			verdict: "FAIL",
		},
		{
			name: "nothing ran",
			test: "TestA",
			out:  "testing: warning: no tests to run\nPASS\n",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			verdict, reason := innerResult(c.out, c.test)
			assert.Equal(t, c.verdict, verdict)
			assert.Equal(t, c.reason, reason)
		})
	}
}
