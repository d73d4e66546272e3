# An mmengine config as a job writes it: the two companion lines, then the usual sections.
custom_imports = dict(imports=["nanwatch.integrations.mmengine"], allow_failed_imports=False)
custom_hooks = [dict(type="NanwatchHook")]

model = dict(type="ToyDetector")
train_dataloader = dict(
    dataset=dict(type="ToyDetDataset"),
    sampler=dict(type="DefaultSampler", shuffle=False),
    batch_size=2,
    num_workers=0,
)
optim_wrapper = dict(optimizer=dict(type="SGD", lr=0.01))
train_cfg = dict(by_epoch=True, max_epochs=1)
default_hooks = dict(logger=dict(type="LoggerHook", interval=5))
randomness = dict(seed=0)
val_dataloader = dict(
    dataset=dict(type="ToyDetDataset"),
    sampler=dict(type="DefaultSampler", shuffle=False),
    batch_size=4,
    num_workers=0,
)
val_cfg = dict()
val_evaluator = dict(type="ToyCount")
