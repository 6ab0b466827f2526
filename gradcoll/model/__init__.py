"""The cost model of the allreduce algorithms (`gradcoll.model.costmodel`) and the simulated network
(`gradcoll.model.sim`: transports and kernels that advance virtual clocks). The algorithms read the fitted
model to choose for ``algorithm="auto"``, and `gradcoll.algorithms.simulate` runs them on the simulated
network; nothing here imports the algorithms."""
