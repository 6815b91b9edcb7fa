package permanent_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/agent/permanent"
)

var errCause = errors.New("bytes do not match")

// refusal carries the mark without being a permanent.Error.
type refusal struct{}

func (refusal) Error() string   { return "refused" }
func (refusal) Permanent() bool { return true }

func TestTheMarkIsFoundThroughWrapping(t *testing.T) {
	err := fmt.Errorf("create vm1: %w", permanent.Errorf("image: %w", errCause))
	assert.True(t, permanent.Is(err))
	assert.ErrorIs(t, err, errCause, "the cause stays matchable")
	assert.True(t, permanent.Is(fmt.Errorf("admit: %w", refusal{})), "any error may carry the mark")
	assert.False(t, permanent.Is(errCause))
	assert.False(t, permanent.Is(nil))
}

func TestWrapKeepsNilAndDoesNotWrapTwice(t *testing.T) {
	assert.NoError(t, permanent.Wrap(nil))
	once := permanent.Wrap(errCause)
	assert.True(t, permanent.Is(once))
	assert.Same(t, once, permanent.Wrap(once))
}
