package deptest

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

// recorder is a testing.TB that keeps what a check reports instead of
// failing the test running it.
type recorder struct {
	testing.TB
	errs []string
}

func (r *recorder) Helper() {}

func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
	r.TB.FailNow()
}

func (r *recorder) Fatal(args ...any) { r.Fatalf("%s", fmt.Sprint(args...)) }

func TestABrokenRuleIsReportedWithItsChainAndReason(t *testing.T) {
	// cmd/eitri wires the control plane, so a rule forbidding it must fail,
	// through the chain that brings server/store in.
	r := &recorder{TB: t}
	Rules{
		Packages: []string{"./cmd/eitri"},
		BadDeps:  map[string]string{Module + "/server/store": "a reason"},
	}.Check(r)
	if assert.NotEmpty(t, r.errs) {
		assert.Contains(t, r.errs[0], "github.com/a73x/eitri/cmd/eitri depends on github.com/a73x/eitri/server/store (github.com/a73x/eitri/cmd/eitri → ")
		assert.True(t, strings.HasSuffix(r.errs[0], ": a reason"), r.errs[0])
	}
}

func TestOnlyAdmitsWhatItNamesAndThePackagesOwnTree(t *testing.T) {
	r := &recorder{TB: t}
	Rules{
		Packages: []string{"./wire/..."},
		Only:     []string{Module + "/gen/..."},
		OnlyWhy:  "only gen",
	}.Check(r)
	assert.Empty(t, r.errs, "wire/ depends on gen/ and itself")

	r = &recorder{TB: t}
	Rules{
		Packages: []string{"./wire/jointoken"},
		Only:     []string{Module + "/wire/vmstate"},
		OnlyWhy:  "not gen",
	}.Check(r)
	assert.NotEmpty(t, r.errs, "the join token codec is encoded with gen/'s messages")
	for _, e := range r.errs {
		assert.True(t, strings.HasSuffix(e, ": not gen"), e)
	}
}

func TestTestsAreHeldToTheRulesButMayUseTestHelpers(t *testing.T) {
	// agent/netsetup's tests use agent/netnstest, a test helper.
	r := &recorder{TB: t}
	Rules{
		Packages: []string{"./agent/netsetup"},
		Only:     []string{Module + "/agent/permanent"},
		Tests:    true,
	}.Check(r)
	assert.Empty(t, r.errs)

	// cmd/eitri's tests start real control planes.
	r = &recorder{TB: t}
	Rules{
		Packages: []string{"./cmd/eitri"},
		BadDeps:  map[string]string{Module + "/server/auth": "tests too"},
		Tests:    true,
	}.Check(r)
	assert.Contains(t, strings.Join(r.errs, "\n"), "tests of github.com/a73x/eitri/cmd/eitri import github.com/a73x/eitri/server/auth: tests too")
}

func TestARuleOnAPackageThatDoesNotExistIsAnError(t *testing.T) {
	r := &recorder{TB: t}
	Rules{
		Packages: []string{"./wire/..."},
		BadDeps:  map[string]string{Module + "/server/nosuch/...": "moved away"},
	}.Check(r)
	assert.Contains(t, strings.Join(r.errs, "\n"), "the rule on github.com/a73x/eitri/server/nosuch/... names no package in the module")
}

func TestStdlibOnlyRefusesThirdPartyCode(t *testing.T) {
	r := &recorder{TB: t}
	Rules{Packages: []string{"./wire/jointoken"}, StdlibOnly: "no third party"}.Check(r)
	assert.Contains(t, strings.Join(r.errs, "\n"), ": no third party", "the codec uses protobuf")

	r = &recorder{TB: t}
	Rules{Packages: []string{"./agent/permanent"}, StdlibOnly: "no third party"}.Check(r)
	assert.Empty(t, r.errs)
}
