package store

import "context"

// Reader reads the store inside one of its write transactions (see
// CreateVMAdmitted). Its methods mean what the Store's of the same name do.
type Reader struct{ tx queryer }

// ListVMs: see Store.ListVMs.
func (r Reader) ListVMs(ctx context.Context, ownerID string) ([]VM, error) {
	if ownerID == "" {
		return queryVMs(ctx, r.tx, ``)
	}
	return queryVMs(ctx, r.tx, `WHERE owner_id = $1`, ownerID)
}

// ListVMsByHost: see Store.ListVMsByHost.
func (r Reader) ListVMsByHost(ctx context.Context, hostID string) ([]VM, error) {
	return queryVMs(ctx, r.tx, `WHERE host_id = $1`, hostID)
}

// CountExposuresByOwner: see Store.CountExposuresByOwner.
func (r Reader) CountExposuresByOwner(ctx context.Context, ownerID string) (int64, error) {
	return countExposuresByOwner(ctx, r.tx, ownerID)
}

// QuotaDefaults: see Store.QuotaDefaults.
func (r Reader) QuotaDefaults(ctx context.Context) (Limits, error) {
	return scanLimits(r.tx.QueryRowContext(ctx, selectQuotaDefaults))
}

// UserQuota: see Store.UserQuota.
func (r Reader) UserQuota(ctx context.Context, userID string) (Limits, error) {
	return scanLimits(r.tx.QueryRowContext(ctx, selectUserQuota, userID))
}
