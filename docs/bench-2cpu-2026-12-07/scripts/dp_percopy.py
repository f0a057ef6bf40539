"""DataParallel as it was before section 7: each gradient copied into its bucket by its own copy_
as it became ready, and back by one copy_ each after the wait (the variant `percopy` of
dp_metering_variants.py; the library now packs and unpacks a bucket with one torch._foreach_copy_)."""
from parallel_mini.parallel.data import DataParallel, grad_of


class PerCopy(DataParallel):
    def _on_grad_ready(self, p):
        if self._ready_order is not None and self._index[p] not in self._ready_order:
            self._ready_order.append(self._index[p])
        if not self._syncing:
            return
        bucket = self._bucket_of[p]
        if not hasattr(bucket, "view_of"):  # p -> its view, as Bucket kept them then
            bucket.view_of = dict(zip(bucket.params, bucket.views))
        bucket.view_of[p].copy_(grad_of(p))
        bucket.ready.add(p)
        self._ready_count += 1
        self._launch_ready_buckets()

    def _wait_and_unpack(self):
        for b in self.buckets:
            b.handle.wait()
            b.flat /= self.n
            for p, view in zip(b.params, b.views):
                grad_of(p).copy_(view)
            b.ready.clear()
            b.handle = None
        self._next_bucket = 0
        self._ready_count = 0
        if self._ready_order is not None:
            self._rebuild_buckets()
