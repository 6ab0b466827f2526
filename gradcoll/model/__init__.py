"""The cost model of the allreduce algorithms (`gradcoll.model.costmodel`) and the simulated network
that runs the real algorithm code against it (`gradcoll.model.sim`, imported on its own: it sits above
the algorithms, which read the fitted model to choose for ``algorithm="auto"``)."""
